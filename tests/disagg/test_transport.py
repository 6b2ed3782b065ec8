"""TCP transport between a sender and a live receiver: bytes land in the right blocks, waits
before/after arrival, refused connections, cancel while pending and while sending, key reuse."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from pdserve.disagg.resource_store import KVLoadError
from pdserve.disagg.transport import tcp_sender
from pdserve.disagg.transport.base import LayerWrite
from pdserve.disagg.transport.regions import KVRegions
from pdserve.disagg.transport.sockets import send_all
from pdserve.disagg.transport.tcp_sender import TcpSender
from pdserve.disagg.wire import SideChannelData
from tests.disagg.kvfixtures import (
    NUM_LAYERS,
    ManualEvent,
    Receiver,
    caches,
    connect,
    layers_received,
    record_frames,
    wait_for_layer,
    writing,
)


@pytest.fixture
def receiver():  # type: ignore[no-untyped-def]
    r = Receiver()
    yield r
    r.close()


class Completions:
    def __init__(self, sender: TcpSender | None = None) -> None:
        self.results: list[Exception | None] = []
        self.counted: list[int] = []  # the sender's byte counter as each write completed
        self.sender = sender
        self.cond = threading.Condition()

    def done(self, err: Exception | None) -> None:
        with self.cond:
            if self.sender is not None:
                self.counted.append(self.sender.bytes_sent)
            self.results.append(err)
            self.cond.notify_all()

    def wait(self, n: int, timeout: float = 5.0) -> list[Exception | None]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.results) >= n, timeout)
            return list(self.results)


def write_all_layers(
    sender: TcpSender,
    peer: str,
    key: str,
    src: list[int],
    dst: list[int],
    done: Completions,
    events: list[ManualEvent] | None = None,
) -> None:
    for layer in range(NUM_LAYERS):
        kwargs = {"event": events[layer]} if events else {}
        sender.submit(LayerWrite(peer, key, layer, src, dst, time.time() + 10, done.done, **kwargs))


def test_blocks_arrive_exactly_and_waiter_before_or_after(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    def send_then_stall(
        sock: socket.socket, buffers: list[memoryview | bytes], deadline: float | None = None
    ) -> int:
        sent = send_all(sock, buffers, deadline)
        time.sleep(0.1)  # the sender thread descheduled once its bytes are out: acks come first
        return sent

    monkeypatch.setattr(tcp_sender, "send_all", send_then_stall)
    src_caches = caches(seed=3)
    sender = TcpSender(KVRegions(src_caches))
    try:
        for key, wait_first in (("before", True), ("after", False)):
            receiver.register(key, [5, 6, 1])
            done = Completions(sender)
            result: list[object] = []
            waiter = threading.Thread(
                target=lambda k=key, out=result: out.append(
                    receiver.store.load_cache_sync(k, time.time() + 5)
                )
            )
            if wait_first:
                waiter.start()
            counted_before = sender.bytes_sent
            write_all_layers(sender, receiver.address, key, [0, 1, 7], [5, 6, 1], done)
            assert done.wait(NUM_LAYERS) == [None] * NUM_LAYERS
            # Bytes count as sent by the time a write completes (never after: a caller that
            # sees its request finished reads a counter that includes it).
            kv = NUM_LAYERS * 3 * KVRegions(src_caches).block_bytes
            assert done.counted[-1] - counted_before >= kv
            receiver.store.put_side_channel(
                key, SideChannelData(has_first_token=True, first_token=0), time.time() + 5
            )
            if not wait_first:
                time.sleep(0.05)
                waiter.start()
            waiter.join(5)
            assert result, f"waiter ({key}) got nothing"
            for layer in range(NUM_LAYERS):
                for s, d in ((0, 5), (1, 6), (7, 1)):
                    assert torch.equal(receiver.caches[layer][d], src_caches[layer][s])
        untouched = [b for b in range(8) if b not in (5, 6, 1)]
        assert all(receiver.caches[0][b].abs().sum() == 0 for b in untouched)
    finally:
        sender.close()


def test_layers_that_queued_up_travel_as_one_frame_and_land_exactly(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes queued while the sender was busy go out together: every layer of one request
    (same blocks and heads) in one frame, with one header and one acknowledgement, and each
    layer's blocks land as they are at the source."""
    frames = record_frames(monkeypatch)
    busy, release = threading.Event(), threading.Event()

    def first_send_waits(
        sock: socket.socket, buffers: list[memoryview | bytes], deadline: float | None = None
    ) -> int:
        if not busy.is_set():  # the first send holds the sender thread until all are queued
            busy.set()
            assert release.wait(5)
        return send_all(sock, buffers, deadline)

    monkeypatch.setattr(tcp_sender, "send_all", first_send_waits)
    src_caches = caches(seed=5)
    sender = TcpSender(KVRegions(src_caches))
    try:
        receiver.register("warm", [0])
        receiver.register("k", [6, 2, 3])
        done = Completions()
        sender.submit(
            LayerWrite(receiver.address, "warm", 0, [0], [0], time.time() + 10, done.done)
        )
        assert busy.wait(5)
        write_all_layers(sender, receiver.address, "k", [1, 4, 5], [6, 2, 3], done)
        release.set()
        assert done.wait(1 + NUM_LAYERS) == [None] * (1 + NUM_LAYERS)
    finally:
        sender.close()
    assert frames == [("warm", 0, 1), ("k", 0, NUM_LAYERS)]
    for layer in range(NUM_LAYERS):
        for s, d in ((1, 6), (4, 2), (5, 3)):
            assert torch.equal(receiver.caches[layer][d], src_caches[layer][s])


def test_connection_refused_names_the_peer() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        sender = TcpSender(KVRegions(caches()))
        done = Completions()
        try:
            write_all_layers(sender, f"127.0.0.1:{port}", "k", [0], [0], done)
            errors = done.wait(NUM_LAYERS)
        finally:
            sender.close()
    assert all(e is not None and f"127.0.0.1:{port}" in str(e) for e in errors)


def test_idle_peer_connections_are_closed_by_a_sweep_not_by_every_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection to a peer unused for PEER_IDLE_S is closed by a later write to another peer
    once SWEEP_S has passed since the last sweep, and not by a write before that (each sweep
    locks every connection's queue: per write, it cost O(peers))."""
    monkeypatch.setattr(tcp_sender, "PEER_IDLE_S", 0.05)
    monkeypatch.setattr(tcp_sender, "SWEEP_S", 2.0)
    with socket.socket() as a, socket.socket() as b:
        for s in (a, b):
            s.bind(("127.0.0.1", 0))  # bound but not listening: each write fails at once
        first, second = (f"127.0.0.1:{s.getsockname()[1]}" for s in (a, b))
        start = time.monotonic()
        sender = TcpSender(KVRegions(caches()))
        done = Completions()
        try:
            write_all_layers(sender, first, "a", [0], [0], done)
            done.wait(NUM_LAYERS)
            time.sleep(0.1)  # `first` idle past PEER_IDLE_S
            write_all_layers(sender, second, "b", [0], [0], done)
            if time.monotonic() - start < tcp_sender.SWEEP_S:  # no sweep due yet
                assert first in sender._peers
            time.sleep(tcp_sender.SWEEP_S)
            write_all_layers(sender, second, "c", [0], [0], done)
            done.wait(3 * NUM_LAYERS)
            assert first not in sender._peers
            assert second in sender._peers
        finally:
            sender.close()


def test_cancel_while_pending_skips_queued_writes(receiver: Receiver) -> None:
    receiver.register("c", [2])
    sender = TcpSender(KVRegions(caches()))
    events = [ManualEvent() for _ in range(NUM_LAYERS)]
    done = Completions()
    try:
        write_all_layers(sender, receiver.address, "c", [0], [2], done, events)
        events[0].fire()
        assert wait_for_layer(receiver.store, "c", 0, time.time() + 5)
        sender.cancel("c")  # layers 1.. are queued behind unfired events
        for e in events[1:]:
            e.fire()
        results = done.wait(NUM_LAYERS)
    finally:
        sender.close()
    # Layer 0 completes when its ack arrives, possibly after the cancelled ones.
    assert results.count(None) == 1
    assert sum("cancelled" in str(e) for e in results if e is not None) == NUM_LAYERS - 1
    assert layers_received(receiver.store, "c") == {0}


def test_cancel_while_transferring_defers_and_a_stalled_writer_releases_by_deadline(
    receiver: Receiver,
) -> None:
    """Decode cancels while a frame is mid-flight from a peer that then stalls: cancel returns
    at once (the engine thread never waits), the blocks stay held while the frame writes, and
    the writer gives up at the entry's deadline, which releases them."""
    receiver.register("t", [3, 4], timeout=1.0)
    sock = connect(receiver.address)
    from pdserve.disagg.proto import pdserve_pb2 as pb
    from pdserve.disagg.transport.base import encode_header

    header = pb.TransferFrameHeader(
        unique_key="t",
        layer=0,
        block_ids=[3, 4],
        head_count=2,
        block_bytes=receiver.regions.block_bytes,
    )
    try:
        sock.sendall(encode_header(header) + b"\x01" * 10)  # a frame cut short: still writing
        deadline = time.time() + 5
        while writing(receiver.store, "t") == 0 and time.time() < deadline:
            time.sleep(0.01)
        assert writing(receiver.store, "t") == 1
        start = time.monotonic()
        assert receiver.store.cancel("t")  # a writer is still in the blocks
        assert time.monotonic() - start < 0.1
        assert receiver.store.stats().entries == 1  # draining: not free yet
        assert receiver.store.pop_released() == []
        released: list[str] = []
        deadline = time.time() + 5
        while not released and time.time() < deadline:
            released = receiver.store.pop_released()
            time.sleep(0.02)
        assert released == ["t"]  # the peer never finished the frame: released by deadline
        assert time.monotonic() - start < 1.0 + 0.5 + 1.0
        assert receiver.store.stats().entries == 0
    finally:
        sock.close()
    with pytest.raises(KVLoadError):
        receiver.store.load_cache_sync("t", time.time() + 0.1)


def test_same_key_concurrently_is_refused(receiver: Receiver) -> None:
    receiver.register("dup", [1])
    with pytest.raises(ValueError, match="already in use"):
        receiver.register("dup", [2])


def test_extra_blocks_are_refused(receiver: Receiver) -> None:
    receiver.register("x", [1, 2])
    before = receiver.snapshot()
    sender = TcpSender(KVRegions(caches()))
    done = Completions()
    try:
        sender.submit(
            LayerWrite(receiver.address, "x", 0, [0, 1, 2], [1, 2, 3], time.time() + 5, done.done)
        )
        done.wait(1)
    finally:
        sender.close()
    deadline = time.time() + 5
    while not receiver.store.frames_rejected and time.time() < deadline:
        time.sleep(0.01)
    assert receiver.store.frames_rejected.get("foreign_block") == 1
    assert all(torch.equal(a, b) for a, b in zip(before, receiver.caches, strict=True))


def test_a_link_whose_socket_is_numbered_past_1024_is_acknowledged(receiver: Receiver) -> None:
    """select() cannot watch a descriptor numbered 1024 or more (a busy node has that many
    open): the link's acknowledgement reader must still work there."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 2048), hard))
    fillers = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    assert fillers[-1] >= 1024  # the link's socket will be numbered above them
    sender = TcpSender(KVRegions(caches(seed=4)))
    try:
        receiver.register("high", [2, 3])
        done = Completions(sender)
        write_all_layers(sender, receiver.address, "high", [0, 1], [2, 3], done)
        assert done.wait(NUM_LAYERS) == [None] * NUM_LAYERS
    finally:
        sender.close()
        for fd in fillers:
            os.close(fd)
