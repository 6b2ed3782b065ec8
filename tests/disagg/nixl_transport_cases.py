"""The NIXL transport between a sender and a live receiver (two agents in this process, UCX on
loopback): blocks land exactly where the frame says and nowhere else, in as few descriptors as
the layout allows; a write to an unregistered agent, a frame for an unknown key and a cancelled
write move nothing; notifications from an agent decode never learnt are ignored.

Run by test_transport_nixl.py in a process of its own: NIXL's wheel bundles its own abseil,
and loading it beside grpc_tools' protoc extension (either order) aborts the process."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from pdserve.disagg.kv_receiver import KVReceiver
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.resource_store import ResourceStore
from pdserve.disagg.transport.base import LayerWrite
from pdserve.disagg.transport.nixl_agent import NixlAgent, run_descs
from pdserve.disagg.transport.nixl_receiver import NixlReceiver
from pdserve.disagg.transport.nixl_sender import NixlSender
from pdserve.disagg.transport.regions import KVRegions
from pdserve.engine.failure import FailureReason, RequestFailed
from tests.disagg.kvfixtures import (
    NUM_LAYERS,
    ManualEvent,
    caches,
    layers_received,
    record_frames,
)

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # UCX would pick network interfaces itself


class Pair:
    """A NIXL sender over random source caches and a receiver over zeroed target caches."""

    def __init__(self, like_a_node: bool = False) -> None:
        """`like_a_node`: the receiver polls fast only while the store expects frames, and the
        store wakes it when an entry is registered (as a decode node wires them)."""
        self.src = caches(seed=5)
        self.dst = caches(fill=0.0)
        self.store = ResourceStore(on_register=lambda: self.receiver.wake())
        expecting = self.store.expecting if like_a_node else (lambda: True)
        self.receiver = NixlReceiver(
            KVReceiver(self.store, KVRegions(self.dst)).open, KVRegions(self.dst), expecting
        )
        self.sender = NixlSender(KVRegions(self.src))
        problem = self.sender.register_peer(self.receiver.address, self.receiver.metadata())
        assert problem is None, problem
        self.receiver.add_peer(self.sender.metadata())
        self.peer = self.receiver.address

    def register(self, key: str, blocks: list[int]) -> None:
        bytes_per_block = KVRegions(self.dst).block_bytes
        self.store.register(
            key, f"req-{key}", blocks, len(blocks), NUM_LAYERS, bytes_per_block, time.time() + 10
        )

    def write_all(
        self, key: str, src: list[int], dst: list[int], events: list[ManualEvent] | None = None
    ) -> list[RequestFailed | None]:
        """Submit every layer; their completions (None or the error), in order."""
        results: list[RequestFailed | None] = [None] * NUM_LAYERS
        left = threading.Semaphore(0)

        def done_of(layer: int):  # type: ignore[no-untyped-def]
            def done(err: RequestFailed | None) -> None:
                results[layer] = err
                left.release()

            return done

        for layer in range(NUM_LAYERS):
            extra = {"event": events[layer]} if events else {}
            write = LayerWrite(
                self.peer, key, layer, src, dst, time.time() + 10, done_of(layer), **extra
            )
            self.sender.submit(write)
        if events:
            return results  # the caller fires the events and waits
        for _ in range(NUM_LAYERS):
            assert left.acquire(timeout=10), "a write never completed"
        return results

    def close(self) -> None:
        self.sender.close()
        self.receiver.stop()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_a_transfer_after_idle_is_read_at_once_not_at_the_next_idle_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An idle decode's NIXL receiver polls slowly; registering an entry wakes it, so the first
    transfer after idle does not wait for the next idle poll (made a minute long here: without
    the wake-up the writes would not complete within write_all's 10 s)."""
    from pdserve.disagg.transport import nixl_receiver

    monkeypatch.setattr(nixl_receiver, "IDLE_POLL_S", 60.0)
    p = Pair(like_a_node=True)
    try:
        time.sleep(2 * nixl_receiver.BUSY_FOR_S)  # idle: in its minute-long wait now
        src, dst = [0, 3], [4, 1]
        p.register("after-idle", dst)
        assert p.write_all("after-idle", src, dst) == [None] * NUM_LAYERS
        for layer in range(NUM_LAYERS):
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(p.dst[layer][d], p.src[layer][s])
    finally:
        p.close()


def test_layers_that_queued_up_are_read_in_one_frame_and_land_exactly(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Writes queued while the sender waited on another layer are announced together: every
    layer of one request in one notification (one READ, one acknowledgement), each layer's
    blocks landing as they are at the source."""
    frames = record_frames(monkeypatch)
    pair = Pair()  # its receiver holds the recording open
    request.addfinalizer(pair.close)
    pair.register("warm", [0])
    pair.register("k", [6, 2])
    gate = ManualEvent()  # holds the sender thread on "warm" while "k" queues up
    done = threading.Semaphore(0)
    results: list[object] = []

    def finished(err: object) -> None:
        results.append(err)
        done.release()

    write = LayerWrite(pair.peer, "warm", 0, [0], [0], time.time() + 10, finished, event=gate)
    pair.sender.submit(write)
    for layer in range(NUM_LAYERS):
        pair.sender.submit(
            LayerWrite(pair.peer, "k", layer, [1, 4], [6, 2], time.time() + 10, finished)
        )
    gate.fire()
    for _ in range(1 + NUM_LAYERS):
        assert done.acquire(timeout=10), "a write never completed"
    assert results == [None] * (1 + NUM_LAYERS)
    assert frames == [("warm", 0, 1), ("k", 0, NUM_LAYERS)]
    for layer in range(NUM_LAYERS):
        for s, d in ((1, 6), (4, 2)):
            assert torch.equal(pair.dst[layer][d], pair.src[layer][s])


def test_run_descs_make_one_descriptor_per_run_on_both_sides() -> None:
    src, dst = run_descs(1000, 5000, [0, 1, 2, 7, 3, 4], [4, 5, 6, 0, 9, 10], 10)
    # 0-2 -> 4-6 together; 7 -> 0 alone; 3-4 -> 9-10 together (3 does not follow 7)
    assert src.tolist() == [[1000, 30, 0], [1070, 10, 0], [1030, 20, 0]]
    assert dst.tolist() == [[5040, 30, 0], [5000, 10, 0], [5090, 20, 0]]


def test_blocks_land_exactly_and_nowhere_else(pair: Pair) -> None:
    src, dst = [0, 1, 2, 7], [5, 6, 1, 3]  # a run of two, then scattered blocks
    pair.register("k", dst)
    assert pair.write_all("k", src, dst) == [None] * NUM_LAYERS
    assert layers_received(pair.store, "k") == set(range(NUM_LAYERS))
    for layer in range(NUM_LAYERS):
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(pair.dst[layer][d], pair.src[layer][s])
        untouched = [b for b in range(8) if b not in dst]
        assert all(pair.dst[layer][b].abs().sum() == 0 for b in untouched)
    assert pair.sender.bytes_sent == NUM_LAYERS * len(src) * KVRegions(pair.src).block_bytes


def test_a_frame_for_an_unknown_key_is_refused_and_moves_nothing(pair: Pair) -> None:
    results = pair.write_all("nobody", [0, 1], [2, 3])
    assert all(r is not None and "unknown_key" in str(r) for r in results), results
    assert all(c.abs().sum() == 0 for c in pair.dst)
    # Layers that queued up share a frame: one to NUM_LAYERS frames, each refused and counted.
    assert 1 <= pair.receiver.stats()["refused_frames"] <= NUM_LAYERS


def test_an_unregistered_agent_gets_nothing(pair: Pair) -> None:
    pair.peer = "pdserve-decode-unknown"
    results = pair.write_all("k", [0], [0])
    assert all(
        r is not None and r.failure.reason == FailureReason.PEER_UNAVAILABLE for r in results
    )
    assert pair.sender.register_peer("pdserve-decode-x", b"") is not None  # no metadata
    assert pair.sender.register_peer("pdserve-decode-x", pair.receiver.metadata()) is not None


def test_cancel_while_pending_skips_queued_writes(pair: Pair) -> None:
    pair.register("c", [2])
    events = [ManualEvent() for _ in range(NUM_LAYERS)]
    results = pair.write_all("c", [0], [2], events)
    pair.sender.cancel("c")
    for e in events:
        e.fire()
    deadline = time.monotonic() + 10
    while any(r is None for r in results) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(r is not None and r.failure.reason == FailureReason.CANCELLED for r in results)
    assert all(c.abs().sum() == 0 for c in pair.dst)


def test_notifications_from_an_agent_decode_never_learnt_are_ignored(pair: Pair) -> None:
    pair.register("k", [1])
    stranger = NixlAgent("stranger", KVRegions(caches(seed=9)))
    try:
        stranger.add_remote(pair.receiver.metadata())
        header = pb.TransferFrameHeader(
            kind=pb.TransferFrameHeader.DATA,
            unique_key="k",
            layer=0,
            block_ids=[1],
            head_count=KVRegions(pair.dst).num_kv_heads,
            block_bytes=KVRegions(pair.dst).block_bytes,
        )
        frame = pb.NixlFrame(header=header, src_block_ids=[0])
        stranger.send_notif(pair.receiver.address, frame.SerializeToString())
        deadline = time.monotonic() + 5
        while pair.receiver.stats()["unknown_agent"] == 0 and time.monotonic() < deadline:
            stranger.notifications()  # progress the stranger's side
            time.sleep(0.01)
        assert pair.receiver.stats()["unknown_agent"] == 1
        assert all(c.abs().sum() == 0 for c in pair.dst)
        assert layers_received(pair.store, "k") == set()
    finally:
        stranger.close()


def test_a_prefill_holding_decodes_peer_info_cannot_write_decodes_memory(pair: Pair) -> None:
    """Decode gives prefill only how to reach its agent, no memory keys: NIXL's own API,
    used as a hostile prefill node would, cannot even prepare a write into decode's KV."""
    before = [c.clone() for c in pair.dst]
    agent = pair.sender.agent._agent  # NIXL itself, under pdserve's sender
    src, dst = pair.src[0], pair.dst[0]
    n = dst.numel() * dst.element_size()
    local = agent.get_xfer_descs([(src.data_ptr(), n, 0)], "DRAM")
    remote = agent.get_xfer_descs([(dst.data_ptr(), n, 0)], "DRAM")
    refused: Exception | None = None
    try:
        handle = agent.initialize_xfer("WRITE", local, remote, pair.peer)
    except Exception as e:  # NIXL_ERR_NOT_FOUND: no backend knows that memory
        refused = e
    else:
        agent.transfer(handle)
        deadline = time.monotonic() + 5
        while agent.check_xfer_state(handle) == "PROC" and time.monotonic() < deadline:
            time.sleep(0.01)
    assert refused is not None, "prefill could prepare a write into decode's memory"
    assert all(torch.equal(a, b) for a, b in zip(before, pair.dst, strict=True))
