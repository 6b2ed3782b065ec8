"""One TCP connection of the sending side and the thread that reads its acknowledgements:
writes complete in order as acks arrive (a NACK fails only its own frame); every write still
unacknowledged fails if the connection ends or if the oldest one outlives its request's
deadline (a stalled receiver), so no frame is lost silently and no wait is unbounded.

Lifecycle: made on connect -> `expect_ack` per frame sent -> `fail_unacked` when it breaks ->
`close` (idempotent with a break) joins the reader.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections import deque

from pdserve.disagg.transport.base import ACK_OK, Completion, TransportError, nack_reason
from pdserve.disagg.transport.sockets import shutdown
from pdserve.engine.failure import Failure, FailureReason

ACK_POLL_S = 0.25  # how often a link with frames in flight checks their deadlines
ACK_GRACE_S = 0.5  # beyond a request's deadline, for an acknowledgement already on its way


class Link:
    """One TCP connection. A reader thread completes the writes in order as acks arrive (a NACK
    fails only its own frame), and fails every unacknowledged write if the connection ends or
    the oldest unacknowledged frame outlives its request's deadline (a stalled receiver), so no
    frame is lost silently and no wait is unbounded."""

    def __init__(self, peer: str, sock: socket.socket) -> None:
        self.peer = peer
        self.sock = sock
        self.unacked: deque[tuple[Completion, float]] = deque()  # (done, deadline)
        self.lock = threading.Lock()
        self.alive = True
        self.reader = threading.Thread(target=self._read_acks, name=f"kv-ack-{peer}", daemon=True)
        self.reader.start()

    def expect_ack(self, done: Completion, deadline: float) -> None:
        with self.lock:
            self.unacked.append((done, deadline))

    def _error(self, reason: FailureReason, message: str) -> TransportError:
        return TransportError(Failure(reason, f"peer {self.peer}: {message}", "sending", self.peer))

    def _refused(self, byte: int) -> TransportError:
        why = nack_reason(byte)
        reason = (
            FailureReason.CANCELLED if why == "cancelled_key" else FailureReason.TRANSFER_FAILED
        )
        return self._error(reason, f"frame refused by the receiver ({why})")

    def _overdue(self) -> bool:
        with self.lock:
            return bool(self.unacked) and time.time() > self.unacked[0][1] + ACK_GRACE_S

    def _read_acks(self) -> None:
        error = "connection closed by the receiver"
        try:
            poller = select.poll()  # not select(): it cannot watch descriptors past 1023
            poller.register(self.sock, select.POLLIN)
            while True:
                if not poller.poll(ACK_POLL_S * 1000):
                    if self._overdue():
                        error = "no acknowledgement by the request's deadline (receiver stalled)"
                        break
                    continue
                data = self.sock.recv(4096)
                if not data:
                    break
                for byte in data:
                    with self.lock:
                        done = self.unacked.popleft()[0] if self.unacked else None
                    if done is not None:
                        done(None if byte == ACK_OK else self._refused(byte))
        except (OSError, ValueError) as e:  # ValueError: the socket was closed under poll
            error = f"connection lost: {e}"
        self.fail_unacked(error)
        shutdown(self.sock)  # a sendmsg blocked on a stalled receiver ends too

    def fail_unacked(self, error: str) -> None:
        with self.lock:
            self.alive = False
            pending = [done for done, _ in self.unacked]
            self.unacked.clear()
        message = f"{error} before acknowledging the frame"
        for done in pending:
            done(self._error(FailureReason.TRANSFER_FAILED, message))

    def close(self) -> None:
        shutdown(self.sock)
        self.sock.close()
        self.reader.join(timeout=5)
