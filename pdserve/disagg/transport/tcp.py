"""TCP transport: zero-copy on both ends. The sender hands memoryviews of the source blocks to
`sendmsg` (no copy into a buffer); the receiver `recv_into`s straight into the target blocks and
acknowledges each frame with one byte, which completes the write on the sender (as an RDMA
completion would): a frame can fail, but never vanish.

Connections are persistent, one per peer, reused across requests. Each peer connection has
one sender thread fed by a queue (a fixed number of threads: one per peer, never one per
request); the receiver has one thread per incoming connection, i.e. per prefill peer.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.resource_store import FrameRejected
from pdserve.disagg.transport.base import (
    HEADER_LEN,
    MAX_HEADER_BYTES,
    Completion,
    KVRegions,
    LayerWrite,
    TransferSender,
    TransportError,
)

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
IOV_MAX = 1024  # buffers per sendmsg/recvmsg_into call (Linux's limit)
MAX_BATCH = 8  # frames per sendmsg


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host or "127.0.0.1", int(port)


def _tune(sock: socket.socket) -> None:
    # Buffer sizes are left to the kernel's autotuning (setting them disables it, and was
    # slower here).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def send_all(sock: socket.socket, buffers: list[memoryview | bytes]) -> int:
    """sendmsg until every buffer is out (sendmsg may stop part-way)."""
    pending = [b if isinstance(b, memoryview) else memoryview(b) for b in buffers]
    total = sum(len(b) for b in pending)
    while pending:
        sent = sock.sendmsg(pending[:IOV_MAX])
        while sent:
            if sent >= len(pending[0]):
                sent -= len(pending[0])
                pending.pop(0)
            else:
                pending[0] = pending[0][sent:]
                sent = 0
    return total


def encode_header(header: pb.TransferFrameHeader) -> bytes:
    body = header.SerializeToString()
    return HEADER_LEN.pack(len(body)) + body


ACK_OK = b"\x01"


@dataclass
class _Failure:
    unique_key: str
    error: str


class _Link:
    """One TCP connection. The receiver acknowledges every frame with one byte once its bytes
    are in decode's blocks; a reader thread completes the writes in order as acks arrive, and
    fails every unacknowledged write if the connection ends (so no frame is lost silently)."""

    def __init__(self, peer: str, sock: socket.socket) -> None:
        self.peer = peer
        self.sock = sock
        self.unacked: deque[Completion] = deque()
        self.lock = threading.Lock()
        self.alive = True
        self.reader = threading.Thread(target=self._read_acks, name=f"kv-ack-{peer}", daemon=True)
        self.reader.start()

    def expect_ack(self, done: Completion) -> None:
        with self.lock:
            self.unacked.append(done)

    def _read_acks(self) -> None:
        error = "connection closed by the receiver"
        try:
            while True:
                data = self.sock.recv(4096)
                if not data:
                    break
                for byte in data:
                    with self.lock:
                        done = self.unacked.popleft() if self.unacked else None
                    if done is not None:
                        done(None if byte == ACK_OK[0] else TransportError("frame refused"))
        except OSError as e:
            error = f"connection lost: {e}"
        self.fail_unacked(error)

    def fail_unacked(self, error: str) -> None:
        with self.lock:
            self.alive = False
            pending = list(self.unacked)
            self.unacked.clear()
        for done in pending:
            done(TransportError(f"peer {self.peer}: {error} before acknowledging the frame"))

    def close(self) -> None:
        _shutdown(self.sock)
        self.sock.close()
        self.reader.join(timeout=5)


class _PeerConnection:
    """One persistent connection to a receiver (replaced when it fails) and its sender thread."""

    def __init__(
        self, peer: str, regions: KVRegions, on_sent: Callable[[int], None], delay_s: float = 0.0
    ) -> None:
        self.peer = peer
        self.delay_s = delay_s
        self.regions = regions
        self.on_sent = on_sent
        self.jobs: queue.Queue[LayerWrite | _Failure | None] = queue.Queue()
        self.cancelled: set[str] = set()
        self.lock = threading.Lock()
        self.link: _Link | None = None
        self.thread = threading.Thread(target=self._run, name=f"kv-send-{peer}", daemon=True)
        self.thread.start()

    def _connect(self) -> _Link:
        if self.link is not None and not self.link.alive:
            self._drop()
        if self.link is None:
            try:
                sock = socket.create_connection(_split_address(self.peer), CONNECT_TIMEOUT_S)
            except OSError as e:
                raise TransportError(f"cannot connect to KV receiver {self.peer}: {e}") from e
            sock.settimeout(None)
            _tune(sock)
            self.link = _Link(self.peer, sock)
        return self.link

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
            if isinstance(job, _Failure):
                self._send_failure(job)
                continue
            batch = [job]
            # Writes already queued and ready go out together: one sendmsg for many frames.
            while len(batch) < MAX_BATCH and not self.jobs.empty():
                nxt = self.jobs.queue[0]
                if not isinstance(nxt, LayerWrite) or not nxt.event.ready():
                    break
                batch.append(self.jobs.get_nowait())  # type: ignore[arg-type]
            self._write(batch)

    def _is_cancelled(self, key: str) -> bool:
        with self.lock:
            return key in self.cancelled

    def _ready(self, job: LayerWrite) -> Exception | None:
        """Wait for the layer's event; an error if the write must not be sent."""
        where = f"peer {self.peer}, unique key {job.unique_key}, layer {job.layer}"
        remaining = job.deadline - time.time()
        if remaining <= 0 or not job.event.wait(remaining):
            return TransportError(f"deadline passed before layer was ready ({where})")
        if self.delay_s and not self._is_cancelled(job.unique_key):
            time.sleep(self.delay_s)
        if self._is_cancelled(job.unique_key):
            return TransportError(f"unique key {job.unique_key} cancelled before sending")
        return None

    def _frame(self, job: LayerWrite) -> list[memoryview | bytes]:
        header = pb.TransferFrameHeader(
            kind=pb.TransferFrameHeader.DATA,
            unique_key=job.unique_key,
            layer=job.layer,
            block_ids=job.dst_blocks,
            head_start=0,
            head_count=self.regions.num_kv_heads,
            block_bytes=self.regions.block_bytes,
        )
        buffers: list[memoryview | bytes] = [encode_header(header)]
        buffers.extend(self.regions.views(job.layer, job.src_blocks))
        return buffers

    def _write(self, batch: list[LayerWrite]) -> None:
        """Send frames in order; each completes by its ack, or now with an error."""
        buffers: list[memoryview | bytes] = []
        sending: list[LayerWrite] = []
        for job in batch:
            error = self._ready(job)
            if error is not None:
                job.done(error)
            else:
                buffers.extend(self._frame(job))
                sending.append(job)
        if not sending:
            return
        try:
            link = self._connect()
        except TransportError as e:
            for job in sending:
                job.done(TransportError(f"unique key {job.unique_key}, layer {job.layer}: {e}"))
            return
        for job in sending:
            link.expect_ack(job.done)
        try:
            sent = send_all(link.sock, buffers)
        except OSError as e:
            link.fail_unacked(f"sending failed: {e}")  # completes these jobs with the error
            self._drop()
            return
        self.on_sent(sent)

    def _send_failure(self, job: _Failure) -> None:
        header = pb.TransferFrameHeader(
            kind=pb.TransferFrameHeader.FAILURE, unique_key=job.unique_key, error=job.error
        )
        try:
            link = self._connect()
            link.expect_ack(lambda err: None)  # best effort: nobody waits on it
            send_all(link.sock, [encode_header(header)])
        except (OSError, TransportError) as e:
            self._drop()
            logger.warning("could not tell %s that %s failed: %s", self.peer, job.unique_key, e)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=5)


class TcpSender(TransferSender):
    def __init__(self, regions: KVRegions) -> None:
        self.regions = regions
        self._peers: dict[str, _PeerConnection] = {}
        self._lock = threading.Lock()
        self._bytes_sent = 0
        self._closed = False

    def _peer(self, peer: str) -> _PeerConnection:
        with self._lock:
            if self._closed:
                raise TransportError("sender is closed")
            conn = self._peers.get(peer)
            if conn is None:
                conn = _PeerConnection(peer, self.regions, self._count, self.testing_delay_s)
                self._peers[peer] = conn
            return conn

    def _count(self, n: int) -> None:
        with self._lock:
            self._bytes_sent += n

    @property
    def bytes_sent(self) -> int:
        return self._bytes_sent

    def submit(self, write: LayerWrite) -> None:
        self._peer(write.peer).jobs.put(write)

    def send_failure(self, peer: str, unique_key: str, error: str) -> None:
        self._peer(peer).jobs.put(_Failure(unique_key, error))

    def cancel(self, unique_key: str) -> None:
        with self._lock:
            conns = list(self._peers.values())
        for conn in conns:
            with conn.lock:
                conn.cancelled.add(unique_key)

    def forget(self, unique_key: str) -> None:
        """The key's writes have all completed; drop its cancellation mark."""
        with self._lock:
            conns = list(self._peers.values())
        for conn in conns:
            with conn.lock:
                conn.cancelled.discard(unique_key)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._peers.values())
            self._peers.clear()
        for conn in conns:
            conn.close()


def recv_exact_into(sock: socket.socket, views: list[memoryview]) -> None:
    """Scatter-read exactly sum(len(v)) bytes into `views` with few syscalls (recvmsg_into)."""
    pending = [v for v in views if len(v)]
    while pending:
        n, _, _, _ = sock.recvmsg_into(pending[:IOV_MAX])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        while n:
            if n >= len(pending[0]):
                n -= len(pending[0])
                pending.pop(0)
            else:
                pending[0] = pending[0][n:]
                n = 0


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]


class TcpReceiverServer:
    """Accepts prefill connections; each connection's thread reads frames and hands them to
    `receive(header, fill)` (the KVReceiver), which validates before any byte is written."""

    def __init__(
        self,
        receive: Callable[[pb.TransferFrameHeader, Callable[[list[memoryview]], None]], None],
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self._receive = receive
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._conns: dict[int, tuple[socket.socket, str | None]] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self.connections_closed_on_reject = 0
        self._accept_thread = threading.Thread(target=self._accept, name="kv-accept", daemon=True)
        self._accept_thread.start()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            _tune(sock)
            threading.Thread(target=self._serve, args=(sock,), name="kv-recv", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with self._lock:
            self._conns[sock.fileno()] = (sock, None)
        fd = sock.fileno()
        try:
            while True:
                size = bytearray(HEADER_LEN.size)
                recv_exact(sock, memoryview(size))
                (length,) = HEADER_LEN.unpack(size)
                if length > MAX_HEADER_BYTES:
                    raise FrameRejected("bad_header", f"header of {length} bytes")
                body = bytearray(length)
                recv_exact(sock, memoryview(body))
                header = pb.TransferFrameHeader.FromString(bytes(body))
                with self._lock:
                    self._conns[fd] = (sock, header.unique_key)
                self._receive(header, lambda views: self._fill(sock, views))
                with self._lock:
                    self._conns[fd] = (sock, None)
                sock.sendall(ACK_OK)  # the bytes are in the target blocks
        except FrameRejected as e:
            self.connections_closed_on_reject += 1
            logger.warning("closing transfer connection: rejected frame: %s", e)
        except (OSError, ConnectionError) as e:
            if not self._stopping:
                logger.info("transfer connection closed: %s", e)
        except Exception:  # a malformed header must not kill the node; it closes this peer
            logger.exception("closing transfer connection after an unexpected error")
        finally:
            with self._lock:
                self._conns.pop(fd, None)
            sock.close()

    @staticmethod
    def _fill(sock: socket.socket, views: list[memoryview]) -> None:
        recv_exact_into(sock, views)

    def abort_key(self, unique_key: str) -> None:
        """Shut down connections that are writing `unique_key` right now."""
        with self._lock:
            socks = [s for s, key in self._conns.values() if key == unique_key]
        for s in socks:
            _shutdown(s)

    def stop(self) -> None:
        self._stopping = True
        _shutdown(self._listener)  # wakes the blocked accept()
        self._listener.close()
        with self._lock:
            socks = [s for s, _ in self._conns.values()]
        for s in socks:
            _shutdown(s)


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
