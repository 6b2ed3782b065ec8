"""TCP transport, receiving side: accepts prefill connections; each connection's thread reads
frames and hands them to `receive(header, fill)` (the KV receiver), which validates before any
byte is written; `fill` then `recvmsg_into`s straight into the target blocks, and the frame is
acknowledged with one byte. One thread per incoming connection, i.e. per prefill peer.
"""

from __future__ import annotations

import logging
import socket
import threading

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.transport.base import (
    HEADER_LEN,
    MAX_HEADER_BYTES,
    FrameRejected,
    Receive,
    TransferReceiver,
)
from pdserve.disagg.transport.sockets import ACK_OK, recv_exact, recv_exact_into, shutdown, tune

logger = logging.getLogger(__name__)


class TcpReceiverServer(TransferReceiver):
    def __init__(self, receive: Receive, host: str = "127.0.0.1", port: int = 0) -> None:
        self._receive = receive
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.port = int(self._listener.getsockname()[1])
        self.address = f"{host}:{self.port}"
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
            tune(sock)
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
                self._receive(header, lambda views: recv_exact_into(sock, views))
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

    def advertised(self, host: str | None) -> str:
        return f"{host}:{self.port}" if host else self.address

    def abort_key(self, unique_key: str) -> None:
        """Shut down connections that are writing `unique_key` right now."""
        with self._lock:
            socks = [s for s, key in self._conns.values() if key == unique_key]
        for s in socks:
            shutdown(s)

    def stop(self) -> None:
        self._stopping = True
        shutdown(self._listener)  # wakes the blocked accept()
        self._listener.close()
        with self._lock:
            socks = [s for s, _ in self._conns.values()]
        for s in socks:
            shutdown(s)
