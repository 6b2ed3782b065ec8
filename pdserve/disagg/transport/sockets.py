"""Socket helpers of the TCP transport: scatter-gather sends and receives that move whole
buffers with few syscalls, and connection set-up and teardown."""

from __future__ import annotations

import contextlib
import socket

IOV_MAX = 1024  # buffers per sendmsg/recvmsg_into call (Linux's limit)
ACK_OK = b"\x01"  # the receiver's acknowledgement of a frame whose bytes are in place


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host or "127.0.0.1", int(port)


def tune(sock: socket.socket) -> None:
    # Buffer sizes are left to the kernel's autotuning (setting them disables it, and was
    # slower here).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


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
