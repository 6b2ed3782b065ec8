"""NIXL transport, receiving side (decode). KV is pulled: prefill announces each ready layer
with a notification (a NixlFrame: decode's target blocks and its own source blocks), and
decode READs prefill's blocks into its own, so only decode ever writes decode's memory.

One thread serves every prefill peer. For each batch of a peer's notifications it hands every
frame to `open` (the KV receiver validates it before any byte moves, exactly as for TCP) and
posts its READ (of every layer a frame carries; one descriptor per run of consecutive ids on
both sides; for a slice of a
tensor-parallel rank's heads, K and V of each block), and only then waits for the reads: the
layers of a prompt announced together move together, not one round trip after another. Each
write is closed when its read ends, and the batch is acknowledged to prefill in one
notification, which lets prefill free its blocks. A read never outlives its wait: past a
frame's deadline (plus a grace) the peer is dropped, which ends its transfers in flight, before
the blocks are given back.

The thread polls again at once after handling notifications, every 100 µs for 50 ms after the
last one, every 1 ms while `expecting()` (some entry waits for frames: a layer's read starts
at most 1 ms after prefill announces it, for ~3% of a core while transfers are pending) and
every 50 ms otherwise: an idle node spends about 1% of a core here. Registering an entry
wakes it at once (`wake`), so the first transfer after idle does not wait for that poll.
Peers are agents whose metadata decode learnt from an authenticated probe (`add_peer`);
notifications from any other agent are ignored.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.transport.base import (
    FrameCorrupt,
    FrameRefused,
    FrameRejected,
    Open,
    OpenFrame,
    TransferReceiver,
)
from pdserve.disagg.transport.nixl_agent import NixlAgent, run_descs, slice_descs
from pdserve.disagg.transport.regions import KVRegions
from pdserve.disagg.wire import nixl_ack, nixl_acks, nixl_shard

logger = logging.getLogger(__name__)

FRAME_GRACE_S = 0.25  # beyond the entry's deadline, for a read already on its way
BUSY_POLL_S = 100e-6
SPIN_S = 2e-3  # a read in flight is polled without sleeping this long (progress is ours)
QUIET_POLL_S = 1e-3
IDLE_POLL_S = 50e-3
BUSY_FOR_S = 0.05  # poll fast this long after the last notification
MAX_PEERS = 1024
MAX_IN_FLIGHT = 32  # reads posted before the first is waited for (a layer each)


class _Peer:
    def __init__(self, info: pb.NixlPeer, link: int, num_kv_heads: int) -> None:
        self.agent_metadata = info.agent_metadata
        self.num_blocks = info.num_blocks
        self.block_bytes = info.block_bytes
        self.link = link
        whole = nixl_shard(0, num_kv_heads, info.layer_addresses, info.block_bytes)
        self.shards = list(info.shards) or [whole]  # its tensor-parallel ranks' KV

    def holder(self, first: int, count: int) -> pb.NixlShard | None:
        """The peer's first rank holding heads [first, first + count), or None."""
        shard: pb.NixlShard
        for shard in self.shards:
            if shard.head_start <= first and first + count <= shard.head_start + shard.num_heads:
                return shard
        return None


@dataclass
class _Read:
    frame: OpenFrame
    handle: object  # NIXL's transfer handle


class NixlReceiver(TransferReceiver):
    def __init__(
        self,
        open_frame: Open,
        regions: KVRegions,
        expecting: Callable[[], bool] = lambda: True,
    ) -> None:
        self._open = open_frame
        self._expecting = expecting
        self.regions = regions
        self.agent = NixlAgent("decode", regions)
        self.address = self.agent.name  # prefill sends to this agent
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._next_link = 1
        self._stopping = threading.Event()
        self._wake = threading.Event()  # set by stop, and when frames are expected again
        self.frames_refused = 0
        self.frames_rejected = 0
        self.reads_aborted = 0
        self.unknown_notifications = 0
        self._thread = threading.Thread(target=self._run, name="kv-recv-nixl", daemon=True)
        self._thread.start()

    def metadata(self) -> bytes:
        """What prefill nodes get (to notify this agent): no memory keys, so no peer can
        write decode's KV; decode only ever reads."""
        return self.agent.connection_metadata

    def add_peer(self, metadata: bytes) -> None:
        """Learn a prefill agent from its probe answer (a NixlPeer); repeated probes refresh it."""
        info = pb.NixlPeer.FromString(metadata)
        name = self.agent.add_remote(info.agent_metadata)
        with self._lock:
            known = self._peers.pop(name, None)
            link = known.link if known is not None else self._next_link
            self._next_link += known is None
            self._peers[name] = _Peer(info, link, self.regions.num_kv_heads)
            while len(self._peers) > MAX_PEERS:
                oldest = next(iter(self._peers))
                del self._peers[oldest]
                self.agent.remove_remote(oldest)

    def _run(self) -> None:
        last_busy = 0.0
        while not self._stopping.is_set():
            try:
                notifs = self.agent.notifications()
            except Exception:
                logger.exception("reading NIXL notifications failed")
                notifs = {}
            now = time.monotonic()
            for peer, messages in notifs.items():
                last_busy = now
                for first in range(0, len(messages), MAX_IN_FLIGHT):
                    acks = self._batch(peer, messages[first : first + MAX_IN_FLIGHT])
                    if not acks.acks:
                        continue
                    try:  # one message for the batch: fewer round trips under backlog
                        self.agent.send_notif(peer, acks.SerializeToString())
                    except Exception as e:  # prefill is gone: its deadline frees its blocks
                        logger.warning("cannot acknowledge frames to %s: %s", peer, e)
            if notifs:
                continue  # more may have come while these were handled
            if time.monotonic() - last_busy <= BUSY_FOR_S:
                pause = BUSY_POLL_S
            else:
                pause = QUIET_POLL_S if self._expecting() else IDLE_POLL_S
            self._wake.wait(pause)
            self._wake.clear()

    def _batch(self, name: str, messages: list[bytes]) -> pb.NixlAcks:
        """Handle a peer's frames: every read is posted before any is waited for, so they
        move together; the acknowledgements of those that got one."""
        acks = nixl_acks()
        with self._lock:
            peer = self._peers.get(name)
        if peer is None:
            self.unknown_notifications += len(messages)
            logger.warning("ignoring a notification from unknown NIXL agent %s", name)
            return acks
        reads: list[_Read] = []
        for message in messages:
            try:
                read = self._start(name, peer, message, acks)
            except Exception:  # the thread serves every peer: it must live
                logger.exception("handling a notification from %s failed", name)
                continue
            if read is not None:
                reads.append(read)
        self._wait(name, peer, reads, acks)
        return acks

    def _start(self, name: str, peer: _Peer, message: bytes, acks: pb.NixlAcks) -> _Read | None:
        """Validate one frame and post its read; a refused one is acknowledged as such."""
        try:
            frame = pb.NixlFrame.FromString(message)
        except Exception as e:  # protobuf's DecodeError, or worse
            self.frames_rejected += 1
            logger.warning("ignoring a malformed notification from %s: %s", name, e)
            return None
        header = frame.header
        try:
            opened = self._open(header, peer.link)
            if opened is None:  # a FAILURE frame: handled, not acknowledged
                return None
            try:
                handle = self._post(name, peer, frame, opened.views)
            except BaseException:
                opened.close(False)
                raise
            return _Read(opened, handle)
        except FrameRefused as e:
            self.frames_refused += 1
            logger.info("refused a frame from %s: %s", name, e)
            refused, text = e.reason, str(e)
        except FrameRejected as e:
            self.frames_rejected += 1
            logger.warning("rejected a frame from %s: %s", name, e)
            refused, text = e.reason, str(e)
        except OSError as e:  # the read could not be posted: the entry is failed already
            refused, text = "read_failed", str(e)
        if header.kind == pb.TransferFrameHeader.DATA:
            acks.acks.append(nixl_ack(header, refused, text))
        return None

    def _post(
        self, name: str, peer: _Peer, frame: pb.NixlFrame, views: Iterable[memoryview]
    ) -> object:
        """Post the READ of the frame's source blocks, in each of its layers, into `views`
        (decode's validated target blocks); its handle. Raises OSError if the frame names
        memory the peer does not have."""
        header, regions = frame.header, self.regions
        src, dst = list(frame.src_block_ids), list(header.block_ids)
        layers = range(header.layer, header.layer + (header.layer_count or 1))
        if len(src) != len(dst) or not 0 <= layers.start < layers.stop <= regions.num_layers:
            raise OSError(f"frame from {name} names {len(src)} source blocks, layers {layers}")
        first, count = header.head_start, header.head_count or regions.num_kv_heads
        source = peer.holder(first, count)
        if (
            (src and (min(src) < 0 or max(src) >= peer.num_blocks))
            or peer.block_bytes != regions.block_bytes
            or source is None
            or source.block_bytes != regions.head_bytes * source.num_heads
            or layers.stop > len(source.layer_addresses)
        ):
            raise OSError(f"frame from {name} names source blocks outside its cache")
        # `views` are these layers' views of the frame's target blocks and heads (validated by
        # the receiver); the descriptors name the same bytes by address, layer after layer.
        if sum(len(v) for v in views) != len(layers) * len(dst) * count * regions.head_bytes:
            raise OSError(f"frame from {name}: target views do not cover its blocks")
        index = regions.holder(first, count)
        assert index is not None, "the receiver validated the frame's heads"
        target = regions.shards[index]
        remotes, locals_ = [], []
        for layer in layers:
            remote_base = source.layer_addresses[layer]
            local_base = self.agent.shard_addresses[index][layer]
            if count == source.num_heads == target.num_heads:  # whole blocks: a run each
                size = count * regions.head_bytes
                remote, local = run_descs(remote_base, local_base, src, dst, size)
            else:  # a slice of the heads on either side: K and V of each block
                at = first - source.head_start
                remote = slice_descs(
                    remote_base, src, source.num_heads, at, count, regions.head_bytes
                )
                at = first - target.head_start
                local = slice_descs(
                    local_base, dst, target.num_heads, at, count, regions.head_bytes
                )
            remotes.append(remote)
            locals_.append(local)
        return self.agent.read(name, np.concatenate(locals_), np.concatenate(remotes))

    def _wait(self, name: str, peer: _Peer, reads: list[_Read], acks: pb.NixlAcks) -> None:
        """Wait for the reads to end and close their writes. Past the earliest deadline (plus
        a grace) the peer is dropped, which ends its transfers in flight (so no byte lands
        after this), and every read still in flight fails; the peer is then loaded afresh
        (new connections) for the frames that follow."""
        spin_until = time.monotonic() + SPIN_S
        while reads:
            left = []
            for read in reads:
                state = self.agent.state(read.handle)
                if state == "PROC":
                    left.append(read)
                    continue
                self.agent.release(read.handle)
                self._finish(read, state == "DONE", f"NIXL read from {name} failed", acks)
            reads = left
            if reads and time.time() > min(r.frame.deadline for r in reads) + FRAME_GRACE_S:
                self.reads_aborted += len(reads)
                self.agent.remove_remote(name)
                for read in reads:
                    self.agent.release(read.handle)
                    self._finish(read, False, f"NIXL read from {name} outlived its deadline", acks)
                self.agent.add_remote(peer.agent_metadata)
                return
            if reads and time.monotonic() > spin_until:  # a few MB end within the spin
                time.sleep(BUSY_POLL_S)

    def _finish(self, read: _Read, ok: bool, error: str, acks: pb.NixlAcks) -> None:
        header = read.frame.header
        refused = "read_failed"
        try:
            read.frame.close(ok)
        except FrameCorrupt as e:  # what was READ is not what prefill checksummed
            ok, error, refused = False, str(e), e.reason
        except Exception as e:  # the write's end failed (copying to replicas): not taken
            logger.exception("closing a frame from NIXL failed")
            ok, error = False, f"{type(e).__name__}: {e}"
        acks.acks.append(nixl_ack(header) if ok else nixl_ack(header, refused, error))

    def stats(self) -> dict[str, int]:
        return {
            "refused_frames": self.frames_refused,
            "rejected_frames": self.frames_rejected,
            "reads_aborted": self.reads_aborted,
            "unknown_agent": self.unknown_notifications,
        }

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(5)
        self.agent.close()
