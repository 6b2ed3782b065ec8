"""TCP transport: zero-copy on both ends. The sender hands memoryviews of the source blocks to
`sendmsg` (no copy into a buffer); the receiver `recv_into`s straight into the target blocks.

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
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.resource_store import FrameRejected
from pdserve.disagg.transport.base import (
    HEADER_LEN,
    MAX_HEADER_BYTES,
    KVRegions,
    LayerWrite,
    TransferSender,
    TransportError,
)

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
SOCKET_BUFFER = 4 << 20


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host or "127.0.0.1", int(port)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def send_all(sock: socket.socket, buffers: list[memoryview | bytes]) -> int:
    """sendmsg until every buffer is out (sendmsg may stop part-way)."""
    pending = [memoryview(b).cast("B") for b in buffers]
    total = sum(len(b) for b in pending)
    while pending:
        sent = sock.sendmsg(pending[:512])
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


@dataclass
class _Failure:
    unique_key: str
    error: str


class _PeerConnection:
    """One persistent connection and its sender thread."""

    def __init__(self, peer: str, regions: KVRegions, on_sent: Callable[[int], None]) -> None:
        self.peer = peer
        self.regions = regions
        self.on_sent = on_sent
        self.jobs: queue.Queue[LayerWrite | _Failure | None] = queue.Queue()
        self.cancelled: set[str] = set()
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.thread = threading.Thread(target=self._run, name=f"kv-send-{peer}", daemon=True)
        self.thread.start()

    def _connect(self) -> socket.socket:
        if self.sock is None:
            try:
                sock = socket.create_connection(_split_address(self.peer), CONNECT_TIMEOUT_S)
            except OSError as e:
                raise TransportError(f"cannot connect to KV receiver {self.peer}: {e}") from e
            sock.settimeout(None)
            _tune(sock)
            self.sock = sock
        return self.sock

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                self._drop()
                return
            if isinstance(job, _Failure):
                self._send_failure(job)
                continue
            job.done(self._write(job))

    def _write(self, job: LayerWrite) -> Exception | None:
        with self.lock:
            if job.unique_key in self.cancelled:
                return TransportError(f"unique key {job.unique_key} cancelled before sending")
        where = f"peer {self.peer}, unique key {job.unique_key}, layer {job.layer}"
        remaining = job.deadline - time.time()
        if remaining <= 0 or not job.event.wait(remaining):
            return TransportError(f"deadline passed before layer was ready ({where})")
        with self.lock:
            if job.unique_key in self.cancelled:  # cancelled while the layer computed
                return TransportError(f"unique key {job.unique_key} cancelled before sending")
        header = pb.TransferFrameHeader(
            kind=pb.TransferFrameHeader.DATA,
            unique_key=job.unique_key,
            layer=job.layer,
            block_ids=job.dst_blocks,
            head_start=0,
            head_count=self.regions.num_kv_heads,
            block_bytes=self.regions.block_bytes,
        )
        try:
            sock = self._connect()
            sent = send_all(
                sock, [encode_header(header), *self.regions.views(job.layer, job.src_blocks)]
            )
        except (OSError, TransportError) as e:
            self._drop()
            return TransportError(f"sending failed ({where}): {e}")
        self.on_sent(sent)
        return None

    def _send_failure(self, job: _Failure) -> None:
        header = pb.TransferFrameHeader(
            kind=pb.TransferFrameHeader.FAILURE, unique_key=job.unique_key, error=job.error
        )
        try:
            send_all(self._connect(), [encode_header(header)])
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
                conn = self._peers[peer] = _PeerConnection(peer, self.regions, self._count)
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
        for view in views:
            recv_exact(sock, view)

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
