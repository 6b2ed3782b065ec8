"""TCP transport, receiving side: accepts prefill connections; each connection's thread reads
frames and hands them to `receive(header, fill)` (the KV receiver), which validates before any
byte is written; `fill` then `recvmsg_into`s straight into the target blocks, and the frame is
acknowledged with one byte. A frame for a key that is not live is refused: its payload is
drained and a NACK byte names the reason, and the connection stays up for the other requests
on it. Only a protocol violation closes a connection. One thread per incoming connection, i.e.
per prefill peer.

Timeouts: a frame's payload must arrive by its entry's deadline (plus a grace), so a peer that
stalls mid-frame releases the entry's blocks; an idle connection is watched by TCP keepalive.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from pdserve.config import DEFAULT_MAX_TRANSFER_CONNECTIONS
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.transport.base import (
    ACK_OK,
    HEADER_LEN,
    MAX_HEADER_BYTES,
    FrameRefused,
    FrameRejected,
    Receive,
    TransferReceiver,
    nack_byte,
)
from pdserve.disagg.transport.sockets import discard, recv_exact, recv_exact_into, shutdown, tune

logger = logging.getLogger(__name__)

FRAME_GRACE_S = 0.5  # beyond the entry's deadline, for a payload already on its way
DRAIN_TIMEOUT_S = 5.0


def _timed(sock: socket.socket, seconds: float) -> None:
    sock.settimeout(max(0.05, seconds))


class TcpReceiverServer(TransferReceiver):
    """`max_connections` bounds the inbound connections, and so the threads serving them; one
    beyond it is closed at once (and counted)."""

    def __init__(
        self,
        receive: Receive,
        host: str = "127.0.0.1",
        port: int = 0,
        max_connections: int = DEFAULT_MAX_TRANSFER_CONNECTIONS,
    ) -> None:
        self._receive = receive
        self.max_connections = max_connections
        self.connections_refused = 0
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.port = int(self._listener.getsockname()[1])
        self.address = f"{host}:{self.port}"
        self._conns: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self.connections_closed_on_reject = 0
        self.frames_refused = 0
        self._accept_thread = threading.Thread(target=self._accept, name="kv-accept", daemon=True)
        self._accept_thread.start()

    def advertised(self, host: str | None) -> str:
        return f"{host}:{self.port}" if host else self.address

    def _accept(self) -> None:
        while not self._stopping:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns[sock.fileno()] = sock
            if full:
                self.connections_refused += 1
                logger.warning("refusing a transfer connection: %d open", self.max_connections)
                sock.close()
                continue
            tune(sock)
            threading.Thread(target=self._serve, args=(sock,), name="kv-recv", daemon=True).start()

    @staticmethod
    def _fill(sock: socket.socket, views: list[memoryview], deadline: float) -> None:
        _timed(sock, deadline - time.time() + FRAME_GRACE_S)
        try:
            recv_exact_into(sock, views)
        finally:
            sock.settimeout(None)

    def _frame(self, sock: socket.socket, header: pb.TransferFrameHeader) -> int:
        """Handle one frame; the acknowledgement byte to send."""
        try:
            self._receive(header, lambda views, deadline: self._fill(sock, views, deadline))
            return ACK_OK
        except FrameRefused as e:
            self.frames_refused += 1
            logger.info("refused a frame (payload drained, link kept): %s", e)
            _timed(sock, DRAIN_TIMEOUT_S)
            try:
                discard(sock, len(header.block_ids) * header.block_bytes)
            finally:
                sock.settimeout(None)
            return nack_byte(e.reason)

    def _serve(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        try:
            while True:
                size = bytearray(HEADER_LEN.size)
                recv_exact(sock, memoryview(size))
                (length,) = HEADER_LEN.unpack(size)
                if length > MAX_HEADER_BYTES:
                    raise FrameRejected("bad_header", f"header of {length} bytes")
                body = bytearray(length)
                _timed(sock, DRAIN_TIMEOUT_S)
                recv_exact(sock, memoryview(body))
                sock.settimeout(None)
                header = pb.TransferFrameHeader.FromString(bytes(body))
                sock.sendall(bytes([self._frame(sock, header)]))
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

    def stop(self) -> None:
        self._stopping = True
        shutdown(self._listener)  # wakes the blocked accept()
        self._listener.close()
        with self._lock:
            socks = list(self._conns.values())
        for s in socks:
            shutdown(s)
