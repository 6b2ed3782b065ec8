"""TCP transport, receiving side: accepts prefill connections; each connection's thread reads
frames and hands them to `receive(header, fill)` (the KV receiver), which validates before any
byte is written; `fill` then `recvmsg_into`s straight into the target blocks, and the frame is
acknowledged with one byte. A frame for a key that is not live is refused: its payload is
drained and a NACK byte names the reason, and the connection stays up for the other requests
on it. Only a protocol violation closes a connection. One thread per incoming connection, i.e.
per prefill peer, at most `max_connections` of them.

Each connection first passes the mutual challenge-response of `transport/handshake.py` (the cluster
secret, or an empty key without one); nothing else is read from it before, and a failed one
is closed and counted. Frames then name the connection they came on (see `Receive`).

Exhaustion: at most `MAX_HANDSHAKES_PER_ADDRESS` connections from one address may be in their
handshake at once (more are closed at once and counted), so one unauthenticated host cannot
hold every slot; the accept loop outlives running out of descriptors (EMFILE, ENFILE): it
backs off, counts it and accepts again once descriptors free up.

Timeouts: the handshake (in total) and a header must arrive promptly; a frame's payload must
arrive by its entry's deadline (plus a grace), so a peer that stalls mid-frame releases the entry's
blocks; a connection silent between frames for `idle_timeout_s` is closed; TCP keepalive
finds a peer that vanished.
"""

from __future__ import annotations

import errno
import itertools
import logging
import socket
import threading
import time
from dataclasses import dataclass

from pdserve.config import DEFAULT_MAX_TRANSFER_CONNECTIONS, DEFAULT_TRANSFER_IDLE_S, Secret
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.transport.base import (
    ACK_OK,
    HEADER_LEN,
    MAX_HEADER_BYTES,
    FrameCorrupt,
    FrameRefused,
    FrameRejected,
    Receive,
    TransferReceiver,
    nack_byte,
    payload_bytes,
)
from pdserve.disagg.transport.handshake import (
    HANDSHAKE_TIMEOUT_S,
    HandshakeFailed,
    accept_handshake,
)
from pdserve.disagg.transport.sockets import (
    discard,
    kernel_timeout,
    recv_exact_into,
    shutdown,
    tune,
)

logger = logging.getLogger(__name__)

FRAME_GRACE_S = 0.5  # beyond the entry's deadline, for a payload already on its way
MAX_HANDSHAKES_PER_ADDRESS = 8  # connections from one address still proving the secret
# accept() failing for want of resources: wait and try again (the listener stays up)
TRANSIENT_ACCEPT_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_BACKOFF_S = (0.05, 1.0)  # first and longest wait after such an error
DRAIN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ReceiverLimits:
    """`max_connections` bounds the inbound connections, and so the threads serving them; one
    beyond it is closed at once (and counted). A connection silent `idle_timeout_s` between
    frames is closed, and one that has not proven the secret within `handshake_timeout_s`."""

    max_connections: int = DEFAULT_MAX_TRANSFER_CONNECTIONS
    idle_timeout_s: float = DEFAULT_TRANSFER_IDLE_S
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S


class TcpReceiverServer(TransferReceiver):
    def __init__(
        self,
        receive: Receive,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: Secret | None = None,
        limits: ReceiverLimits = ReceiverLimits(),
    ) -> None:
        self._receive = receive
        self.max_connections = limits.max_connections
        self._secret = secret
        self.idle_timeout_s = limits.idle_timeout_s
        self.handshake_timeout_s = limits.handshake_timeout_s
        self._link_ids = itertools.count(1)
        self.connections_refused = 0
        self.refused_per_address = 0  # one address had MAX_HANDSHAKES_PER_ADDRESS in handshake
        self.accept_errors = 0  # accept() failed for want of descriptors or memory
        self._handshaking: dict[str, int] = {}  # address -> connections in their handshake
        self.handshakes_failed = 0  # closed before any frame: no proof of the secret
        self.connections_idle_closed = 0
        self.headers_rejected = 0  # malformed or oversized headers (the store counts the rest)
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
        backoff = ACCEPT_BACKOFF_S[0]
        while not self._stopping:
            try:
                sock, peer = self._listener.accept()
            except OSError as e:
                if self._stopping or e.errno not in TRANSIENT_ACCEPT_ERRORS:
                    return  # the listener was closed
                self.accept_errors += 1
                logger.warning("transfer accept failed (%s); retrying in %.2fs", e, backoff)
                time.sleep(backoff)
                backoff = min(2 * backoff, ACCEPT_BACKOFF_S[1])
                continue
            backoff = ACCEPT_BACKOFF_S[0]
            address = str(peer[0])
            with self._lock:
                full = len(self._conns) >= self.max_connections
                crowded = self._handshaking.get(address, 0) >= MAX_HANDSHAKES_PER_ADDRESS
                if not (full or crowded):
                    self._conns[sock.fileno()] = sock
                    self._handshaking[address] = self._handshaking.get(address, 0) + 1
            if full or crowded:
                if full:
                    self.connections_refused += 1
                    logger.warning("refusing a transfer connection: %d open", self.max_connections)
                else:
                    self.refused_per_address += 1
                    logger.warning("refusing a transfer connection: %s has %d in handshake",
                                   address, MAX_HANDSHAKES_PER_ADDRESS)  # fmt: skip
                sock.close()
                continue
            tune(sock)
            link = next(self._link_ids)
            threading.Thread(
                target=self._serve, args=(sock, link, address), name="kv-recv", daemon=True
            ).start()

    def _handshake(self, sock: socket.socket, address: str) -> bool:
        """Whether the peer proved the secret (in the handshake's time, counted per address)."""
        try:
            accept_handshake(sock, self._secret, self.handshake_timeout_s)
            return True
        except (HandshakeFailed, OSError) as e:  # TimeoutError is an OSError
            self.handshakes_failed += 1
            logger.warning("closing a transfer connection before any frame: %s", e)
            return False
        finally:
            with self._lock:
                left = self._handshaking.get(address, 1) - 1
                if left:
                    self._handshaking[address] = left
                else:
                    self._handshaking.pop(address, None)

    @staticmethod
    def _fill(sock: socket.socket, views: list[memoryview], deadline: float) -> None:
        recv_exact_into(sock, views, deadline + FRAME_GRACE_S)

    def _frame(self, sock: socket.socket, header: pb.TransferFrameHeader, link: int) -> int:
        """Handle one frame; the acknowledgement byte to send."""
        try:
            fill = lambda views, deadline: self._fill(sock, views, deadline)  # noqa: E731
            self._receive(header, fill, link)
            return ACK_OK
        except FrameCorrupt as e:  # read whole, but not what was sent: its request failed
            logger.warning("refused a frame whose bytes fail their checksum (link kept): %s", e)
            return nack_byte(e.reason)
        except FrameRefused as e:
            self.frames_refused += 1
            logger.info("refused a frame (payload drained, link kept): %s", e)
            discard(sock, payload_bytes(header), time.time() + DRAIN_TIMEOUT_S)
            return nack_byte(e.reason)

    def _header(self, sock: socket.socket) -> pb.TransferFrameHeader | None:
        """The next frame's header; None if the connection stayed idle too long."""
        size = bytearray(HEADER_LEN.size)
        try:
            recv_exact_into(sock, [memoryview(size)], time.time() + self.idle_timeout_s)
        except TimeoutError:
            return None
        (length,) = HEADER_LEN.unpack(size)
        if length > MAX_HEADER_BYTES:
            self.headers_rejected += 1
            raise FrameRejected("bad_header", f"header of {length} bytes")
        body = bytearray(length)
        recv_exact_into(sock, [memoryview(body)], time.time() + DRAIN_TIMEOUT_S)
        try:
            header: pb.TransferFrameHeader = pb.TransferFrameHeader.FromString(bytes(body))
            return header
        except Exception as e:  # protobuf's DecodeError, or worse
            self.headers_rejected += 1
            raise FrameRejected("bad_header", f"malformed header: {type(e).__name__}") from e

    def _serve(self, sock: socket.socket, link: int, address: str) -> None:
        fd = sock.fileno()
        try:
            if not self._handshake(sock, address):
                return
            # Blocking from here on: every read and the acks are bounded in the kernel
            # (SO_RCVTIMEO per read, SO_SNDTIMEO here), with no poll before each call.
            sock.settimeout(None)
            kernel_timeout(sock, socket.SO_SNDTIMEO, DRAIN_TIMEOUT_S)
            while True:
                header = self._header(sock)
                if header is None:
                    self.connections_idle_closed += 1
                    logger.info("closing a transfer connection idle for %.0fs", self.idle_timeout_s)
                    return
                sock.sendall(bytes([self._frame(sock, header, link)]))
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

    def stats(self) -> dict[str, int]:
        return {
            "refused_over_cap": self.connections_refused,
            "refused_per_address": self.refused_per_address,
            "accept_errors": self.accept_errors,
            "handshake_failed": self.handshakes_failed,
            "idle_closed": self.connections_idle_closed,
            "closed_on_reject": self.connections_closed_on_reject,
            "bad_header": self.headers_rejected,
        }

    def stop(self) -> None:
        self._stopping = True
        shutdown(self._listener)  # wakes the blocked accept()
        self._listener.close()
        with self._lock:
            socks = list(self._conns.values())
        for s in socks:
            shutdown(s)
