"""NIXL transport, sending side (prefill). KV is pulled by decode (see nixl_receiver.py): for
each (request, layer) write, once the layer's event is ready, this side announces the layer
with a notification naming decode's target blocks and its own source blocks (consecutive
layers of one request that queued up in one notification, read by one READ), then holds the
blocks until decode acknowledges the read (or refuses the frame). A write completes with
`done(None)` on that acknowledgement, as a TCP write does on its ack; one that is not
acknowledged by its deadline plus a grace completes with an error, which frees the blocks.
Decode's own read stops at the deadline plus a smaller grace (nixl_receiver.FRAME_GRACE_S),
so no read of a block is in flight when it is freed here.

Peers are decode agents registered by their authenticated probes (`register_peer`); a write to
any other name fails at once. One thread serves every peer; it waits on its queue when it has
nothing in flight and polls for acknowledgements every 100 µs while it does.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.transport.base import (
    LayerWrite,
    TransferSender,
    TransportError,
    group_frames,
    ready_after,
)
from pdserve.disagg.transport.nixl_agent import NixlAgent
from pdserve.disagg.transport.regions import KVRegions
from pdserve.disagg.wire import failure_header, frame_block_bytes, nixl_frame
from pdserve.engine.failure import Failure, FailureReason

logger = logging.getLogger(__name__)

ACK_GRACE_S = 0.5  # beyond the write's deadline (larger than decode's read grace)
POLL_S = 100e-6
MAX_GROUP = 32  # queued writes announced together (consecutive layers share a frame)
MAX_PEERS = 1024


@dataclass
class _FailureNotice:
    peer: str
    unique_key: str
    failure: Failure


class NixlSender(TransferSender):
    def __init__(self, regions: KVRegions) -> None:
        super().__init__()
        self.regions = regions
        self.agent = NixlAgent("prefill", regions)
        self._jobs: queue.Queue[LayerWrite | _FailureNotice | None] = queue.Queue()
        # (key, first layer, first head) -> the writes announced in that frame
        self._pending: dict[tuple[str, int, int], list[LayerWrite]] = {}
        self._peers: OrderedDict[str, None] = OrderedDict()  # registered decode agents
        self._lock = threading.Lock()
        self._bytes_sent = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-send-nixl", daemon=True)
        self._thread.start()

    # ---- control plane (the gRPC loop) ------------------------------------------------------

    def metadata(self) -> bytes:
        return self.agent.peer_info()

    def register_peer(self, peer: str, metadata: bytes) -> str | None:
        """Load a decode agent's metadata from its probe; why it cannot be used, or None."""
        if not metadata:
            return "no NIXL agent metadata (is the decode node on --transfer-backend nixl?)"
        try:
            name = self.agent.add_remote(metadata)
        except Exception as e:  # NIXL's own error for metadata it cannot parse
            return f"unusable NIXL agent metadata: {type(e).__name__}: {e}"
        if name != peer:
            return f"agent metadata names {name!r}, not {peer!r}"
        with self._lock:
            self._peers[peer] = None
            self._peers.move_to_end(peer)
            while len(self._peers) > MAX_PEERS:
                oldest, _ = self._peers.popitem(last=False)
                self.agent.remove_remote(oldest)
        return None

    def address_problem(self, peer: str) -> str | None:
        with self._lock:
            known = peer in self._peers
        return None if known else f"NIXL agent {peer!r} is not registered"

    # ---- the interface ----------------------------------------------------------------------

    def submit(self, write: LayerWrite) -> None:
        self._jobs.put(write)

    def send_failure(self, peer: str, unique_key: str, failure: Failure) -> None:
        self._jobs.put(_FailureNotice(peer, unique_key, failure))

    @property
    def bytes_sent(self) -> int:
        return self._bytes_sent

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._jobs.put(None)
        self._thread.join(5)
        self.agent.close()

    # ---- the sender thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._pending:
                try:
                    job = self._jobs.get(timeout=POLL_S)
                except queue.Empty:
                    self._guarded(self._collect_acks)
                    continue
            else:
                job = self._jobs.get()  # nothing in flight: sleep until there is work
            if job is None:
                self._fail_pending("the sender is closed", FailureReason.SHUTTING_DOWN)
                return
            if isinstance(job, LayerWrite):
                for group in group_frames(ready_after(job, self._jobs, MAX_GROUP)):
                    self._guarded(self._announce, group)
            else:
                self._guarded(self._send_failure, job)
            self._guarded(self._collect_acks)

    @staticmethod
    def _guarded(step: Callable[..., None], *args: object) -> None:
        try:
            step(*args)
        except Exception:  # the thread serves every request: it must live
            logger.exception("NIXL sender failed on a job")

    def _wait_ready(self, write: LayerWrite) -> bool:
        """Wait for the layer's event, collecting acknowledgements meanwhile."""
        while not write.event.wait(min(POLL_S * 10, max(0.0, write.deadline - time.time()))):
            if time.time() >= write.deadline:
                return False
            self._collect_acks()
        return True

    def _announce(self, group: list[LayerWrite]) -> None:
        """One notification for `group` (consecutive layers of one request, the same blocks
        and heads); a write that may not be sent completes at once and splits the group."""
        ready: list[LayerWrite] = []
        for write in group:
            error = self._problem(write)
            if error is None:
                ready.append(write)
            else:
                write.done(error)
        for part in group_frames(ready):
            first = part[0]
            try:
                header = self.frame_header(part)
            except (ValueError, IndexError) as e:  # checked by _problem: a bug if it happens
                for write in part:
                    write.done(write.error(FailureReason.INVALID_INPUT, str(e), "sending"))
                continue
            frame = nixl_frame(header, first.src_blocks)
            try:
                self.agent.send_notif(first.peer, frame)
            except Exception as e:
                message = f"cannot notify decode's NIXL agent: {e}"
                for write in part:
                    write.done(write.error(FailureReason.PEER_UNAVAILABLE, message, "sending"))
                continue
            self._pending[(first.unique_key, first.layer, first.head_start)] = part

    def _problem(self, write: LayerWrite) -> TransportError | None:
        """Why `write` must not be announced (its layer never became ready, its key was
        cancelled, its peer or blocks are unknown), or None."""
        if not self._wait_ready(write):
            message = "deadline passed before layer was ready"
            return write.error(FailureReason.DEADLINE, message, "sending")
        error = self.held_back(write)
        if error is not None:
            return error
        if self.address_problem(write.peer) is not None:
            message = "decode's NIXL agent is not registered"
            return write.error(FailureReason.PEER_UNAVAILABLE, message, "sending")
        if any(not 0 <= b < self.regions.num_blocks for b in write.src_blocks):
            message = "source block out of range"
            return write.error(FailureReason.INVALID_INPUT, message, "sending")
        return None

    def _send_failure(self, job: _FailureNotice) -> None:
        frame = nixl_frame(failure_header(job.unique_key, job.failure))
        try:
            self.agent.send_notif(job.peer, frame)
        except Exception as e:
            logger.warning("could not tell %s that %s failed: %s", job.peer, job.unique_key, e)

    def _collect_acks(self) -> None:
        if not self._pending:
            return
        for peer, notes in self.agent.notifications().items():
            for note in notes:
                try:
                    acks = list(pb.NixlAcks.FromString(note).acks)
                except Exception:
                    logger.warning("ignoring a malformed acknowledgement from %s", peer)
                    continue
                for ack in acks:
                    self._acknowledged(peer, ack)
        now = time.time()
        for key, part in list(self._pending.items()):
            if now > min(w.deadline for w in part) + ACK_GRACE_S:
                del self._pending[key]
                message = "decode did not read the layer by the deadline"
                for write in part:
                    write.done(write.error(FailureReason.DEADLINE, message, "transfer"))

    def _acknowledged(self, peer: str, ack: pb.NixlAck) -> None:
        key = (ack.unique_key, ack.layer, ack.head_start)
        part = self._pending.get(key)
        if part is None or part[0].peer != peer:
            return  # late: those writes completed already (their deadline passed)
        del self._pending[key]
        for write in part:
            if ack.refused:
                reason = (
                    FailureReason.CANCELLED
                    if ack.refused == "cancelled_key"
                    else FailureReason.TRANSFER_FAILED
                )
                text = f"frame refused by the receiver ({ack.refused}): {ack.message}"
                write.done(write.error(reason, text, "transfer"))
            else:
                self._bytes_sent += len(write.src_blocks) * frame_block_bytes(
                    self.regions, write.head_count
                )
                write.done(None)

    def _fail_pending(self, message: str, reason: FailureReason) -> None:
        for part in self._pending.values():
            for write in part:
                write.done(write.error(reason, message, "transfer"))
        self._pending.clear()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, LayerWrite):
                job.done(job.error(reason, message, "sending"))
