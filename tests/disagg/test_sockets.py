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
from collections.abc import Iterator
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


def test_send_all_sends_every_view_in_order_taking_them_as_it_goes() -> None:
    data = os.urandom(COUNT * VIEW)
    source = memoryview(data)
    views = [source[i * VIEW : (i + 1) * VIEW] for i in range(COUNT)]
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # small: partial sends
    pulled = [0]
    sender = Observed(a, pulled)
    got = bytearray()

    def read() -> None:
        while chunk := b.recv(1 << 16):
            got.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert send_all(sender, counted(views, pulled), time.time() + 30) == len(data)
    finally:
        sender.close()
        reader.join(30)
        b.close()
    assert bytes(got) == data
    check_calls(sender.calls)


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
