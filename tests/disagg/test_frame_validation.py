"""Hostile or stale frames sent over a raw socket: each is rejected before a byte is written,
the connection is closed and the rejection counted."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.transport.base import encode_header
from tests.disagg.kvfixtures import NUM_BLOCKS, Receiver


@pytest.fixture
def receiver():  # type: ignore[no-untyped-def]
    r = Receiver()
    r.register("live", [1, 2])
    r.register("gone", [3])
    r.store.cancel("gone")
    yield r
    r.close()


def send_frame(address: str, header: pb.TransferFrameHeader, payload: bytes) -> socket.socket:
    host, port = address.split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(encode_header(header) + payload)
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


CASES = {
    "unknown_key": dict(unique_key="nobody", block_ids=[1]),
    "cancelled_key": dict(unique_key="gone", block_ids=[3]),
    "wrong_size": dict(unique_key="live", block_ids=[1], size_delta=8),
    "out_of_range_block": dict(unique_key="live", block_ids=[NUM_BLOCKS + 5]),
    "foreign_block": dict(unique_key="live", block_ids=[4]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_frame_is_rejected_nothing_written_connection_closed(
    receiver: Receiver, case: str
) -> None:
    spec = dict(CASES[case])
    size = receiver.regions.block_bytes + int(spec.pop("size_delta", 0))  # type: ignore[call-overload]
    header = pb.TransferFrameHeader(
        kind=pb.TransferFrameHeader.DATA, layer=0, head_count=2, block_bytes=size, **spec
    )
    before = receiver.snapshot()
    sock = send_frame(receiver.address, header, b"\x7f" * size * len(header.block_ids))
    try:
        assert closed_by_peer(sock)
    finally:
        sock.close()
    assert receiver.store.frames_rejected.get(case) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, receiver.caches, strict=True))
    deadline = time.time() + 2
    while receiver.server.connections_closed_on_reject < 1 and time.time() < deadline:
        time.sleep(0.01)
    assert receiver.server.connections_closed_on_reject == 1
