"""Socket helpers of the TCP transport: scatter-gather sends and receives that move whole
buffers with few syscalls, and connection set-up and teardown."""

from __future__ import annotations

import contextlib
import socket

IOV_MAX = 1024  # buffers per sendmsg/recvmsg_into call (Linux's limit)
DRAIN_CHUNK = 1 << 16
# A peer that vanishes without closing (power loss, partition) is found by TCP keepalive:
# probes after 10 s idle, every 5 s, 3 unanswered probes close the connection.
KEEPALIVE = ((socket.TCP_KEEPIDLE, 10), (socket.TCP_KEEPINTVL, 5), (socket.TCP_KEEPCNT, 3))


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of "host:port"; ValueError if it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port")
    return host or "127.0.0.1", int(port)


def tune(sock: socket.socket) -> None:
    # Buffer sizes are left to the kernel's autotuning (setting them disables it, and was
    # slower here).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in KEEPALIVE:
        sock.setsockopt(socket.IPPROTO_TCP, option, value)


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


def discard(sock: socket.socket, nbytes: int) -> None:
    """Read and drop exactly `nbytes` (the payload of a refused frame)."""
    scratch = memoryview(bytearray(min(nbytes, DRAIN_CHUNK)))
    while nbytes:
        recv_exact(sock, scratch[: min(nbytes, len(scratch))])
        nbytes -= min(nbytes, len(scratch))


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]
