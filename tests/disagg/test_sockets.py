"""The TCP transport's scatter-gather helpers (transport/sockets.py) on a real socket pair:
every byte of many views arrives exactly and in order, through partial sends and receives,
each call moving at most IOV_MAX buffers and about a megabyte; the views are taken from their
iterable as the calls get to them, so a long frame's first bytes leave before its last views
are made."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from pdserve.disagg.transport.sockets import (
    IOV_MAX,
    TAKE,
    WAITALL_BYTES,
    recv_exact_into,
    send_all,
)

VIEW = 700  # bytes: an odd size, so runs end mid-view
COUNT = 4000  # 2.8 MB: several calls of IOV_MAX views or a megabyte


class Observed(socket.socket):
    """A real socket that notes, at each scatter-gather call, how many buffers it was given and
    how many views the caller's iterable had yielded by then."""

    def __init__(self, sock: socket.socket, pulled: list[int]) -> None:
        super().__init__(fileno=sock.detach())
        self.pulled = pulled
        self.calls: list[tuple[int, int]] = []  # (buffers, views pulled so far)

    def sendmsg(self, buffers: Any, *args: Any) -> int:  # type: ignore[override]
        self.calls.append((len(buffers), self.pulled[0]))
        return super().sendmsg(buffers, *args)

    def recvmsg_into(self, buffers: Any, *args: Any) -> Any:  # type: ignore[override]
        self.calls.append((len(buffers), self.pulled[0]))
        return super().recvmsg_into(buffers, *args)


def counted(views: list[memoryview], pulled: list[int]) -> Iterator[memoryview]:
    for v in views:
        pulled[0] += 1
        yield v


def check_calls(calls: list[tuple[int, int]]) -> None:
    assert len(calls) >= COUNT * VIEW // WAITALL_BYTES  # partial calls go on where they ended
    assert all(n <= IOV_MAX for n, _ in calls)
    # The first call went out with about a megabyte's views made (and at most one more batch
    # of TAKE), not all of them.
    assert calls[0][1] <= WAITALL_BYTES // VIEW + TAKE < COUNT


def send_and_read(
    sender: socket.socket, peer: socket.socket, buffers: Iterable[memoryview | bytes]
) -> tuple[int, bytes]:
    """`send_all` of `buffers` on `sender` while a thread reads `peer` to its end: what
    send_all returned and the bytes read. Both sockets are closed."""
    got = bytearray()

    def read() -> None:
        while chunk := peer.recv(1 << 16):
            got.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        sent = send_all(sender, buffers, time.time() + 30)
    finally:
        sender.close()
        reader.join(30)
        peer.close()
    return sent, bytes(got)


def test_send_all_sends_every_view_in_order_taking_them_as_it_goes() -> None:
    data = os.urandom(COUNT * VIEW)
    source = memoryview(data)
    views = [source[i * VIEW : (i + 1) * VIEW] for i in range(COUNT)]
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # small: partial sends
    pulled = [0]
    sender = Observed(a, pulled)
    assert send_and_read(sender, b, counted(views, pulled)) == (len(data), data)
    check_calls(sender.calls)


def test_send_all_sends_bytes_and_views_alike_and_skips_empty_ones() -> None:
    """A frame's header is bytes among its block views: every other buffer here is bytes (and
    every tenth is empty), sent through partial sends whose cuts fall inside either kind (the
    kernel sends part of a call's buffers when its send timeout passes: here each call sends
    the first third of what it is given, plus a little)."""
    data = os.urandom(COUNT * VIEW)
    source = memoryview(data)
    buffers: list[memoryview | bytes] = []
    for i in range(COUNT):
        piece = source[i * VIEW : (i + 1) * VIEW]
        buffers.append(bytes(piece) if i % 2 else piece)
        if i % 10 == 0:
            buffers.append(b"" if i % 20 else memoryview(b""))
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # small: partial sends
    cuts: list[int] = []  # bytes sent by each call
    sender = Observed(a, [0])
    real = sender.sendmsg

    def noted(buffers: Any, *args: Any) -> int:
        want = sum(map(len, buffers)) // 3 + 123
        part: list[Any] = []
        for buffer in buffers:  # the buffers' first `want` bytes
            if want <= 0:
                break
            part.append(memoryview(buffer)[:want])
            want -= len(part[-1])
        cuts.append(real(part, *args))
        return cuts[-1]

    sender.sendmsg = noted  # type: ignore[method-assignment]
    assert send_and_read(sender, b, buffers) == (len(data), data)
    ends = {sum(cuts[: i + 1]) for i in range(len(cuts) - 1)}
    # some call ended inside a bytes buffer and some inside a view
    inside = {(end // VIEW) % 2 for end in ends if end % VIEW}
    assert inside == {0, 1}, f"partial sends ended only inside kind {inside}: {sorted(ends)[:8]}"


def test_recv_exact_into_fills_scattered_views_taking_them_as_it_goes() -> None:
    data = os.urandom(COUNT * VIEW)
    target = bytearray(2 * COUNT * VIEW)
    dest = memoryview(target)
    order = list(range(COUNT))[::-1]  # scattered: every other slot, last first
    views = [dest[2 * i * VIEW : (2 * i + 1) * VIEW] for i in order]
    a, b = socket.socketpair()
    pulled = [0]
    receiver = Observed(b, pulled)
    writer = threading.Thread(target=a.sendall, args=(data,))
    writer.start()
    try:
        recv_exact_into(receiver, counted(views, pulled), time.time() + 30)
    finally:
        writer.join(30)
        a.close()
        receiver.close()
    for k, i in enumerate(order):
        assert target[2 * i * VIEW : (2 * i + 1) * VIEW] == data[k * VIEW : (k + 1) * VIEW]
    assert all(target[(2 * i + 1) * VIEW : (2 * i + 2) * VIEW] == bytes(VIEW) for i in order)
    check_calls(receiver.calls)
