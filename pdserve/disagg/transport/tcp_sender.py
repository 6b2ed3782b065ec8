"""TCP transport, sending side: zero-copy `sendmsg` of memoryviews of the source blocks (no copy
into a buffer). The receiver acknowledges each frame with one byte once its bytes are in
decode's blocks, which completes the write here (as an RDMA completion would): a frame can
fail, but never vanish.

Connections are persistent, one per peer, reused across requests, and open with the mutual
challenge-response of `transport/handshake.py`. Writes that queued up go out in one `sendmsg`,
consecutive layers of one request as one frame (one header, one acknowledgement). Each peer
connection has one
sender thread fed by a queue (a fixed number of threads: one per peer, never one per request)
and one thread reading its acks.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.config import Secret
from pdserve.disagg.transport.base import (
    LayerWrite,
    TransferSender,
    TransportError,
    encode_header,
    group_frames,
    payload_bytes,
    ready_after,
)
from pdserve.disagg.transport.handshake import HandshakeFailed, open_handshake
from pdserve.disagg.transport.regions import KVRegions
from pdserve.disagg.transport.sockets import send_all, split_address, tune
from pdserve.disagg.transport.tcp_link import ACK_GRACE_S, Link
from pdserve.disagg.wire import failure_header
from pdserve.engine.failure import Failure, FailureReason

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
MAX_BATCH = 32  # writes per sendmsg (consecutive layers of one request share a frame)
PEER_IDLE_S = 60.0  # a peer connection unused this long is closed (its thread ends)
SWEEP_S = 1.0  # idle peer connections are looked for at most this often (not per write)


@dataclass
class _FailureNotice:
    unique_key: str
    failure: Failure


class _PeerConnection:
    """One persistent connection to a receiver (replaced when it fails) and its sender thread."""

    def __init__(
        self,
        peer: str,
        sender: TransferSender,
        on_sent: Callable[[int], None],
        on_link: Callable[[], None],
        secret: Secret | None = None,
    ) -> None:
        self.peer = peer
        # The sender's: the frames' headers and views (checksums), cancelled keys, the
        # testing delay.
        self.sender = sender
        self.secret = secret
        self.on_sent = on_sent
        self.on_link = on_link
        self.last_used = time.monotonic()
        self.jobs: queue.Queue[LayerWrite | _FailureNotice | None] = queue.Queue()
        self.link: Link | None = None
        self.thread = threading.Thread(target=self._run, name=f"kv-send-{peer}", daemon=True)
        self.thread.start()

    def _connect(self, deadline: float) -> Link:
        """The link, opened if needed: connect and handshake end by the writes' `deadline`
        (plus the grace an acknowledgement gets) whatever their own limits."""
        if self.link is not None and not self.link.alive:
            self._drop()
        if self.link is None:

            def left() -> float:
                return max(0.1, deadline - time.time() + ACK_GRACE_S)

            try:
                sock = socket.create_connection(
                    split_address(self.peer), min(CONNECT_TIMEOUT_S, left())
                )
            except ValueError as e:  # not host:port
                message = f"bad KV receiver address {self.peer!r}: {e}"
                failure = Failure(FailureReason.INVALID_INPUT, message, "connect", self.peer)
                raise TransportError(failure) from e
            except OSError as e:
                what = f"cannot connect to KV receiver {self.peer}"
                raise self._link_error(what, e, "connect", deadline) from e
            tune(sock)
            try:
                open_handshake(sock, self.secret, left())
            except (HandshakeFailed, OSError) as e:
                sock.close()
                what = f"KV receiver {self.peer} refused the link"
                raise self._link_error(what, e, "handshake", deadline) from e
            self.link = Link(self.peer, sock)
            self.on_link()
        return self.link

    def _link_error(self, what: str, e: Exception, stage: str, deadline: float) -> TransportError:
        late = isinstance(e, TimeoutError) and time.time() >= deadline
        reason = FailureReason.DEADLINE if late else FailureReason.PEER_UNAVAILABLE
        why = "no answer by the request's deadline" if late else str(e)
        failure = Failure(reason, f"{what}: {why}", stage, self.peer)
        return TransportError(failure)

    def _drop(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                self._drop()
                return
            if isinstance(job, _FailureNotice):
                self._send_failure(job)
                continue
            # Writes already queued and ready go out together: one sendmsg for many frames.
            batch = ready_after(job, self.jobs, MAX_BATCH)
            try:
                self._write(batch)
            except Exception:  # the thread serves every request to this peer: it must live
                logger.exception("KV sender to %s failed on a batch; dropping the link", self.peer)
                self._fail_link("sender error")

    def _ready(self, job: LayerWrite) -> TransportError | None:
        """Wait for the layer's event; an error if the write must not be sent."""
        remaining = job.deadline - time.time()
        if remaining <= 0 or not job.event.wait(remaining):
            return job.error(
                FailureReason.DEADLINE, "deadline passed before layer was ready", "sending"
            )
        return self.sender.held_back(job)

    def _write(self, batch: list[LayerWrite]) -> None:
        """Send frames in order; each completes by its ack, or now with an error."""
        buffers: list[Iterable[memoryview | bytes]] = []
        sending: list[tuple[list[LayerWrite], int]] = []
        ready = []
        for job in batch:
            error = self._ready(job)
            if error is not None:
                job.done(error)
            else:
                ready.append(job)
        for group in group_frames(ready):
            first = group[0]
            try:
                header, views = self.sender.data_frame(group)
            except (ValueError, IndexError) as e:  # block ids or layer out of range
                error = first.error(
                    FailureReason.INVALID_INPUT, f"cannot frame the write: {e}", "sending"
                )
                for job in group:
                    job.done(error)
                continue
            encoded = encode_header(header)
            buffers += ([encoded], views)
            sending.append((group, len(encoded) + payload_bytes(header)))
        if not sending:
            return
        deadline = min(job.deadline for group, _ in sending for job in group)
        try:
            link = self._connect(deadline)
        except TransportError as e:
            for group, _ in sending:
                for job in group:
                    job.done(job.error(e.failure.reason, e.failure.message, e.failure.stage))
            return
        for group, nbytes in sending:
            done = functools.partial(self._acknowledged, group, nbytes)
            link.expect_ack(done, min(job.deadline for job in group))
        # A receiver that stops reading must not hold this thread past the requests' deadline.
        link.sock.settimeout(None)  # blocking: the kernel bounds the send (SO_SNDTIMEO)
        try:
            send_all(
                link.sock,
                itertools.chain.from_iterable(buffers),
                max(time.time() + 0.1, deadline + ACK_GRACE_S),
            )
        except OSError as e:
            self._fail_link(f"sending failed: {e}")  # completes these jobs with the error
            return

    def _acknowledged(
        self, group: list[LayerWrite], nbytes: int, error: TransportError | None
    ) -> None:
        """A frame's bytes count as sent once the receiver took them, before its writes
        complete: whoever sees a request finished sees its bytes counted."""
        if error is None:
            self.on_sent(nbytes)
        for job in group:
            job.done(error)

    def _fail_link(self, error: str) -> None:
        if self.link is not None:
            self.link.fail_unacked(error)
        self._drop()

    def _send_failure(self, job: _FailureNotice) -> None:
        try:
            link = self._connect(time.time() + CONNECT_TIMEOUT_S)  # best effort, bounded
            link.expect_ack(lambda err: None, time.time() + CONNECT_TIMEOUT_S)
            link.sock.settimeout(None)
            frame: list[memoryview | bytes] = [
                encode_header(failure_header(job.unique_key, job.failure))
            ]
            send_all(link.sock, frame, time.time() + CONNECT_TIMEOUT_S)
        except (OSError, TransportError) as e:
            self._drop()
            logger.warning("could not tell %s that %s failed: %s", self.peer, job.unique_key, e)

    def idle(self, now: float) -> bool:
        return self.jobs.empty() and now - self.last_used > PEER_IDLE_S

    def close(self, wait: bool = True) -> None:
        self.jobs.put(None)
        if wait:
            self.thread.join(timeout=5)


class TcpSender(TransferSender):
    def __init__(self, regions: KVRegions, secret: Secret | None = None) -> None:
        super().__init__()
        self.regions = regions
        self._secret = secret
        self._peers: dict[str, _PeerConnection] = {}
        self._lock = threading.Lock()
        self._bytes_sent = 0
        self._links_opened = 0
        self._closed = False
        self._swept = time.monotonic()

    def _peer(self, peer: str) -> _PeerConnection:
        now = time.monotonic()
        with self._lock:
            if self._closed:
                failure = Failure(FailureReason.SHUTTING_DOWN, "sender is closed", "", peer)
                raise TransportError(failure)
            if now - self._swept >= SWEEP_S:  # each connection's queue is locked to ask
                self._swept = now
                for name, idle in [(n, c) for n, c in self._peers.items() if c.idle(now)]:
                    del self._peers[name]
                    idle.close(wait=False)  # its thread ends once its queue is drained
            conn = self._peers.get(peer)
            if conn is None:
                conn = _PeerConnection(peer, self, self._count, self._count_link, self._secret)
                self._peers[peer] = conn
            conn.last_used = now
            return conn

    def _count_link(self) -> None:
        with self._lock:
            self._links_opened += 1

    @property
    def links_opened(self) -> int:
        return self._links_opened

    def _count(self, n: int) -> None:
        with self._lock:
            self._bytes_sent += n

    @property
    def bytes_sent(self) -> int:
        return self._bytes_sent

    def address_problem(self, peer: str) -> str | None:
        try:
            split_address(peer)
        except ValueError as e:
            return str(e)
        return None

    def submit(self, write: LayerWrite) -> None:
        self._peer(write.peer).jobs.put(write)

    def send_failure(self, peer: str, unique_key: str, failure: Failure) -> None:
        self._peer(peer).jobs.put(_FailureNotice(unique_key, failure))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._peers.values())
            self._peers.clear()
        for conn in conns:
            conn.close()
