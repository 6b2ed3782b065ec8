"""Hostile or stale frames sent over a raw socket: each is rejected before a byte is written,
the connection is closed and the rejection counted."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.transport.base import ACK_OK, encode_header, nack_byte
from tests.disagg.kvfixtures import NUM_BLOCKS, NUM_LAYERS, Receiver, connect


@pytest.fixture
def receiver():  # type: ignore[no-untyped-def]
    r = Receiver()
    r.register("live", [1, 2])
    r.register("gone", [3])
    r.store.cancel("gone")
    yield r
    r.close()


def send_frame(address: str, header: pb.TransferFrameHeader, payload: bytes) -> socket.socket:
    sock = connect(address)
    sock.sendall(encode_header(header) + payload)
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


VIOLATIONS = {
    "wrong_size": dict(unique_key="live", block_ids=[1], size_delta=8),
    "out_of_range_block": dict(unique_key="live", block_ids=[NUM_BLOCKS + 5]),
    "foreign_block": dict(unique_key="live", block_ids=[4]),
    "duplicate_block": dict(unique_key="live", block_ids=[1, 1]),
    "bad_layer": dict(unique_key="live", block_ids=[1], layer=1, layer_count=NUM_LAYERS),
    # a FAILURE frame has no payload: bytes after one would be read as the next header
    "failure_with_blocks": dict(
        unique_key="live", block_ids=[1], kind=pb.TransferFrameHeader.FAILURE
    ),
}
REFUSALS = {  # well-formed frames for keys that are not live
    "unknown_key": dict(unique_key="nobody", block_ids=[1]),
    "cancelled_key": dict(unique_key="gone", block_ids=[3]),
}


def frame(spec: dict[str, object], block_bytes: int) -> tuple[pb.TransferFrameHeader, bytes]:
    spec = dict(spec)
    size = block_bytes + int(spec.pop("size_delta", 0))  # type: ignore[call-overload]
    kind = spec.pop("kind", pb.TransferFrameHeader.DATA)
    layer = spec.pop("layer", 0)
    header = pb.TransferFrameHeader(kind=kind, layer=layer, head_count=2, block_bytes=size, **spec)
    return header, b"\x7f" * size * len(header.block_ids) * (header.layer_count or 1)


@pytest.mark.parametrize("case", sorted(VIOLATIONS))
def test_protocol_violation_is_rejected_nothing_written_connection_closed(
    receiver: Receiver, case: str
) -> None:
    header, payload = frame(VIOLATIONS[case], receiver.regions.block_bytes)
    before = receiver.snapshot()
    sock = send_frame(receiver.address, header, payload)
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


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_frame_for_a_dead_key_is_nacked_and_the_link_stays_up(
    receiver: Receiver, case: str
) -> None:
    header, payload = frame(REFUSALS[case], receiver.regions.block_bytes)
    before = receiver.snapshot()
    sock = send_frame(receiver.address, header, payload)
    try:
        assert sock.recv(1) == bytes([nack_byte(case)])  # refused alone, payload drained
        assert all(torch.equal(a, b) for a, b in zip(before, receiver.caches, strict=True))
        live, data = frame(dict(unique_key="live", block_ids=[1, 2]), receiver.regions.block_bytes)
        sock.sendall(encode_header(live) + data)  # the same connection serves the live key
        assert sock.recv(1) == bytes([ACK_OK])
    finally:
        sock.close()
    assert receiver.store.frames_rejected.get(case) == 1
    assert receiver.server.connections_closed_on_reject == 0
    assert torch.all(receiver.caches[0][1].flatten().view(torch.uint8) == 0x7F)


def test_a_frame_of_several_layers_is_refused_whole_or_lands_layer_by_layer(
    receiver: Receiver,
) -> None:
    """A frame carrying every layer (one header, the layers' payloads one after another): for a
    dead key all of its payload is drained and the link serves on; for a live key each layer's
    bytes land in that layer's blocks, and the entry counts every layer received."""
    size = receiver.regions.block_bytes
    dead = pb.TransferFrameHeader(
        unique_key="nobody", block_ids=[1, 2], head_count=2, block_bytes=size, layer_count=3
    )
    sock = send_frame(receiver.address, dead, b"\x55" * size * 2 * NUM_LAYERS)
    try:
        assert sock.recv(1) == bytes([nack_byte("unknown_key")])
        live = pb.TransferFrameHeader(
            unique_key="live", block_ids=[2, 1], head_count=2, block_bytes=size, layer_count=3
        )
        payload = b"".join(bytes([0x10 + layer]) * size * 2 for layer in range(NUM_LAYERS))
        sock.sendall(encode_header(live) + payload)
        assert sock.recv(1) == bytes([ACK_OK])
    finally:
        sock.close()
    for layer in range(NUM_LAYERS):
        for block in (1, 2):
            got = receiver.caches[layer][block].flatten().view(torch.uint8)
            assert torch.all(got == 0x10 + layer), (layer, block)
    assert receiver.store.progress("live").layers_done == frozenset(range(NUM_LAYERS))


def test_connections_beyond_the_cap_are_refused_and_the_others_keep_serving() -> None:
    r = Receiver(max_connections=1)
    try:
        r.register("live", [1, 2])
        r.register("other", [3])
        live, data = frame(dict(unique_key="live", block_ids=[1, 2]), r.regions.block_bytes)
        first = send_frame(r.address, live, data)
        try:
            assert first.recv(1) == bytes([ACK_OK])  # served, and still open
            host, port = r.address.split(":")
            second = socket.create_connection((host, int(port)), timeout=5)
            try:
                assert closed_by_peer(second)  # one connection too many
            finally:
                second.close()
            assert r.server.connections_refused == 1
            other, more = frame(dict(unique_key="other", block_ids=[3]), r.regions.block_bytes)
            first.sendall(encode_header(other) + more)  # the first connection still serves
            assert first.recv(1) == bytes([ACK_OK])
        finally:
            first.close()
    finally:
        r.close()
