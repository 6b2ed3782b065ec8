"""NIXL transport, receiving side (decode). KV is pulled: prefill announces each ready layer
with a notification (a NixlFrame: decode's target blocks and its own source blocks), and
decode READs prefill's blocks into its own, so only decode ever writes decode's memory.

One thread serves every prefill peer: it reads notifications, hands each frame to `receive`
(the KV receiver validates it before any byte moves, exactly as for TCP), whose `fill` READs
the blocks (one descriptor per run of consecutive ids on both sides; for a slice of a
tensor-parallel rank's heads, K and V of each block) and waits for the read to finish, then
acknowledges the frame to prefill by notification, which lets prefill free its blocks. A read
never outlives `fill`: past the entry's deadline (plus a grace) the peer is dropped, which
ends its transfers in flight, before the blocks are given back.

The thread polls again at once after handling notifications, every 100 µs for 50 ms after the
last one, every 1 ms while `expecting()` (some entry waits for frames: a layer's read starts
at most 1 ms after prefill announces it, for ~3% of a core while transfers are pending) and
every 50 ms otherwise: an idle node spends about 1% of a core here.
Peers are agents whose metadata decode learnt from an authenticated probe (`add_peer`);
notifications from any other agent are ignored.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.transport.base import (
    FrameRefused,
    FrameRejected,
    KVRegions,
    Receive,
    TransferReceiver,
)
from pdserve.disagg.transport.nixl_agent import NixlAgent, run_descs, slice_descs

logger = logging.getLogger(__name__)

FRAME_GRACE_S = 0.25  # beyond the entry's deadline, for a read already on its way
BUSY_POLL_S = 100e-6
SPIN_S = 2e-3  # a read in flight is polled without sleeping this long (progress is ours)
QUIET_POLL_S = 1e-3
IDLE_POLL_S = 50e-3
BUSY_FOR_S = 0.05  # poll fast this long after the last notification
MAX_PEERS = 1024


class _Peer:
    def __init__(self, info: pb.NixlPeer, link: int, num_kv_heads: int) -> None:
        self.agent_metadata = info.agent_metadata
        self.num_blocks = info.num_blocks
        self.block_bytes = info.block_bytes
        self.link = link
        whole = pb.NixlShard(
            head_start=0,
            num_heads=num_kv_heads,
            layer_addresses=info.layer_addresses,
            block_bytes=info.block_bytes,
        )
        self.shards = list(info.shards) or [whole]  # its tensor-parallel ranks' KV

    def holder(self, first: int, count: int) -> pb.NixlShard | None:
        """The peer's first rank holding heads [first, first + count), or None."""
        for s in self.shards:
            if s.head_start <= first and first + count <= s.head_start + s.num_heads:
                return s
        return None


class NixlReceiver(TransferReceiver):
    def __init__(
        self,
        receive: Receive,
        regions: KVRegions,
        expecting: Callable[[], bool] = lambda: True,
    ) -> None:
        self._receive = receive
        self._expecting = expecting
        self.regions = regions
        self.agent = NixlAgent("decode", regions)
        self.address = self.agent.name  # prefill sends to this agent
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._next_link = 1
        self._stopping = threading.Event()
        self.frames_refused = 0
        self.frames_rejected = 0
        self.reads_aborted = 0
        self.unknown_notifications = 0
        self._thread = threading.Thread(target=self._run, name="kv-recv-nixl", daemon=True)
        self._thread.start()

    def metadata(self) -> bytes:
        return self.agent.metadata

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
                acks = pb.NixlAcks()
                for message in messages:
                    try:
                        ack = self._notification(peer, message)
                    except Exception:  # the thread serves every peer: it must live
                        logger.exception("handling a notification from %s failed", peer)
                        continue
                    if ack is not None:
                        acks.acks.append(ack)
                if acks.acks:  # one message for the batch: fewer round trips under backlog
                    try:
                        self.agent.send_notif(peer, acks.SerializeToString())
                    except Exception as e:  # prefill is gone: its deadline frees its blocks
                        logger.warning("cannot acknowledge frames to %s: %s", peer, e)
            if notifs:
                continue  # more may have come while these were handled
            if time.monotonic() - last_busy <= BUSY_FOR_S:
                pause = BUSY_POLL_S
            else:
                pause = QUIET_POLL_S if self._expecting() else IDLE_POLL_S
            self._stopping.wait(pause)

    def _notification(self, name: str, message: bytes) -> pb.NixlAck | None:
        """Handle one frame; its acknowledgement (None for FAILURE frames and ignored ones)."""
        with self._lock:
            peer = self._peers.get(name)
        if peer is None:
            self.unknown_notifications += 1
            logger.warning("ignoring a notification from unknown NIXL agent %s", name)
            return None
        try:
            frame = pb.NixlFrame.FromString(message)
        except Exception as e:  # protobuf's DecodeError, or worse
            self.frames_rejected += 1
            logger.warning("ignoring a malformed notification from %s: %s", name, e)
            return None
        header = frame.header
        refused, text = "", ""
        try:
            fill = lambda views, deadline: self._fill(name, peer, frame, views, deadline)  # noqa: E731
            self._receive(header, fill, peer.link)
        except FrameRefused as e:
            self.frames_refused += 1
            refused, text = e.reason, str(e)
            logger.info("refused a frame from %s: %s", name, e)
        except FrameRejected as e:
            self.frames_rejected += 1
            refused, text = e.reason, str(e)
            logger.warning("rejected a frame from %s: %s", name, e)
        except OSError as e:  # the read failed: the entry is failed already
            refused, text = "read_failed", str(e)
        if header.kind != pb.TransferFrameHeader.DATA:
            return None
        return pb.NixlAck(
            unique_key=header.unique_key,
            layer=header.layer,
            head_start=header.head_start,
            refused=refused,
            message=text,
        )

    def _fill(
        self,
        name: str,
        peer: _Peer,
        frame: pb.NixlFrame,
        views: list[memoryview],
        deadline: float,
    ) -> None:
        """READ the frame's source blocks into `views` (decode's validated target blocks) and
        wait for the read to end; raises OSError if it fails or outlives the deadline."""
        header, regions = frame.header, self.regions
        src, dst, layer = list(frame.src_block_ids), list(header.block_ids), header.layer
        if len(src) != len(dst) or not 0 <= layer < regions.num_layers:
            raise OSError(f"frame from {name} names {len(src)} source blocks, layer {layer}")
        first, count = header.head_start, header.head_count or regions.num_kv_heads
        source = peer.holder(first, count)
        if (
            (src and (min(src) < 0 or max(src) >= peer.num_blocks))
            or peer.block_bytes != regions.block_bytes
            or source is None
            or source.block_bytes != regions.head_bytes * source.num_heads
            or layer >= len(source.layer_addresses)
        ):
            raise OSError(f"frame from {name} names source blocks outside its cache")
        # `views` are this layer's views of the frame's target blocks and heads (validated by
        # the receiver); the descriptors name the same bytes by address.
        if sum(len(v) for v in views) != len(dst) * count * regions.head_bytes:
            raise OSError(f"frame from {name}: target views do not cover its blocks")
        index = regions.holder(first, count)
        assert index is not None, "the receiver validated the frame's heads"
        target = regions.shards[index]
        remote_base = source.layer_addresses[layer]
        local_base = self.agent.shard_addresses[index][layer]
        if count == source.num_heads == target.num_heads:  # whole blocks: a run per descriptor
            size = count * regions.head_bytes
            remote, local = run_descs(remote_base, local_base, src, dst, size)
        else:  # a slice of the heads on either side: K and V of each block
            at = first - source.head_start
            remote = slice_descs(remote_base, src, source.num_heads, at, count, regions.head_bytes)
            at = first - target.head_start
            local = slice_descs(local_base, dst, target.num_heads, at, count, regions.head_bytes)
        handle = self.agent.read(name, local, remote)
        spin_until = time.monotonic() + SPIN_S
        while True:
            state = self.agent.state(handle)
            if state == "DONE":
                self.agent.release(handle)
                return
            if state == "ERR":
                self.agent.release(handle)
                raise OSError(f"NIXL read from {name} failed")
            if time.time() > deadline + FRAME_GRACE_S:
                self.reads_aborted += 1
                # Dropping the peer ends its transfers in flight: no byte lands after this.
                # Then it is loaded afresh (new connections) for the requests that follow.
                self.agent.remove_remote(name)
                self.agent.release(handle)
                self.agent.add_remote(peer.agent_metadata)
                raise OSError(f"NIXL read from {name} outlived its deadline")
            if time.monotonic() > spin_until:  # a read of a few MB ends within the spin
                time.sleep(BUSY_POLL_S)

    def stats(self) -> dict[str, int]:
        return {
            "refused_frames": self.frames_refused,
            "rejected_frames": self.frames_rejected,
            "reads_aborted": self.reads_aborted,
            "unknown_agent": self.unknown_notifications,
        }

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(5)
        self.agent.close()
