"""Resource store: claim once, waits with deadlines, cancel, expiry, side channel."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.disagg.receive_entry import KVLoadError, TransferStage
from pdserve.disagg.resource_store import ResourceStore
from pdserve.disagg.transport.base import FrameRejected
from pdserve.disagg.wire import SideChannelData

LAYERS = 2
BLOCK = 64


def register(store: ResourceStore, key: str, blocks: list[int], ttl: float = 10.0) -> None:
    store.register(key, f"r-{key}", blocks, len(blocks), LAYERS, BLOCK, time.time() + ttl)


def deliver(store: ResourceStore, key: str, blocks: list[int]) -> None:
    for layer in range(LAYERS):
        entry = store.begin_frame(key, [layer], blocks, BLOCK)
        store.end_frame(entry, [layer], len(blocks), ok=True)


def side(token: int = 5) -> SideChannelData:
    return SideChannelData(has_first_token=True, first_token=token, first_logprob=-0.5)


def complete(store: ResourceStore, key: str, blocks: list[int], token: int = 5) -> None:
    deliver(store, key, blocks)
    assert store.put_side_channel(key, side(token), time.time() + 10)


def empty(store: ResourceStore) -> bool:
    stats = store.stats()
    return stats.entries == 0 and stats.side_channel == 0


def test_claim_once_under_contention() -> None:
    store = ResourceStore()
    register(store, "k", [1, 2])
    complete(store, "k", [1, 2])
    wins: list[object] = []
    barrier = threading.Barrier(8)

    def claimer() -> None:
        barrier.wait()
        r = store.claim("k")
        if r is not None:
            wins.append(r)

    threads = [threading.Thread(target=claimer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert empty(store)


def test_wait_then_claim_and_data_before_wait() -> None:
    store = ResourceStore()
    register(store, "later", [3])
    result: list[object] = []
    waiter = threading.Thread(
        target=lambda: result.append(store.load_cache_sync("later", time.time() + 5))
    )
    waiter.start()  # the waiter is registered before any data arrives
    time.sleep(0.05)
    complete(store, "later", [3], token=7)
    waiter.join(5)
    assert result and result[0].side_channel.first_token == 7  # type: ignore[attr-defined]
    register(store, "early", [4])
    complete(store, "early", [4])  # data arrives first, the waiter comes after
    assert store.load_cache_sync("early", time.time() + 1).side_channel is not None
    assert empty(store)


def test_timeout_names_the_stage() -> None:
    store = ResourceStore()
    register(store, "slow", [1])
    start = time.monotonic()
    with pytest.raises(KVLoadError, match="stage: waiting") as e:
        store.load_cache_sync("slow", time.time() + 0.2)
    assert e.value.timeout and time.monotonic() - start < 1.0
    deliver(store, "slow", [1])  # KV complete, first token missing
    with pytest.raises(KVLoadError, match="waiting for first token"):
        store.load_cache_sync("slow", time.time() + 0.1)


def test_an_expired_entry_with_every_layer_in_says_the_first_token_was_missing() -> None:
    store = ResourceStore()
    register(store, "in", [1], ttl=0.05)
    register(store, "half", [2], ttl=0.05)
    deliver(store, "in", [1])  # every layer arrived; prefill's reply never did
    entry = store.begin_frame("half", [0], [2], BLOCK)
    store.end_frame(entry, [0], 1, ok=True)  # one layer of two
    time.sleep(0.1)
    assert sorted(store.sweep()) == ["half", "in"]
    stages = {key: store.claim(key).failure.stage for key in ("in", "half")}  # type: ignore[union-attr]
    assert stages == {"in": "waiting for first token", "half": "transferring"}


def test_cancel_before_and_while_waiting() -> None:
    store = ResourceStore()
    register(store, "a", [1])
    store.cancel("a")
    with pytest.raises(FrameRejected) as e:
        store.begin_frame("a", [0], [1], BLOCK)
    assert e.value.reason == "cancelled_key"
    assert not store.put_side_channel("a", side(), time.time() + 5)  # late data dropped
    register(store, "b", [2])
    errors: list[Exception] = []

    def wait() -> None:
        try:
            store.load_cache_sync("b", time.time() + 5)
        except KVLoadError as err:
            errors.append(err)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.05)
    store.cancel("b")
    t.join(2)
    assert not t.is_alive() and errors
    assert empty(store)
    with pytest.raises(ValueError, match="already in use"):
        register(store, "b", [2])  # the tombstone keeps the key out


def test_only_the_right_waiter_is_woken_and_several_waiters_on_one_key() -> None:
    store = ResourceStore()
    register(store, "x", [1])
    register(store, "y", [2])
    got: dict[str, list[object]] = {"x": [], "y": []}

    def wait(key: str) -> None:
        try:
            got[key].append(store.load_cache_sync(key, time.time() + 0.5))
        except KVLoadError as e:
            got[key].append(e)

    ts = [threading.Thread(target=wait, args=(k,)) for k in ("x", "y", "y")]
    for t in ts:
        t.start()
    time.sleep(0.05)
    complete(store, "y", [2])
    for t in ts:
        t.join(2)
    assert isinstance(got["x"][0], KVLoadError) and got["x"][0].timeout  # type: ignore[union-attr]
    ys = got["y"]
    assert len(ys) == 2
    assert sum(not isinstance(r, Exception) for r in ys) == 1  # exactly one claimer wins
    loser = next(r for r in ys if isinstance(r, Exception))
    assert "not registered" in str(loser)


def test_expiry_of_entries_and_side_channel() -> None:
    store = ResourceStore()
    register(store, "e", [1], ttl=0.05)
    assert store.put_side_channel("orphan", side(), time.time() + 0.05)  # no entry at all
    time.sleep(0.1)
    expired = store.sweep()
    assert "e" in expired and "orphan" in expired
    assert store.stats().side_channel == 0
    result = store.claim("e")  # failed by the sweep: its owner learns and frees
    assert result is not None and result.error is not None and "deadline" in result.error
    assert empty(store)


def test_side_channel_after_its_deadline_is_dropped() -> None:
    store = ResourceStore()
    register(store, "late", [1])
    deliver(store, "late", [1])
    assert not store.put_side_channel("late", side(), time.time() - 0.01)
    assert store.claim("late") is None  # still incomplete: no first token


def test_token_zero_is_a_first_token() -> None:
    store = ResourceStore()
    register(store, "z", [1])
    complete(store, "z", [1], token=0)
    result = store.claim("z")
    assert result is not None and result.side_channel is not None
    assert result.side_channel.has_first_token and result.side_channel.first_token == 0


def test_stage_only_moves_forward_and_failure_is_claimable() -> None:
    store = ResourceStore()
    register(store, "f", [1, 2])
    entry = store.begin_frame("f", [0], [1, 2], BLOCK)
    assert entry.stage == TransferStage.TRANSFERRING
    store.end_frame(entry, [0], 2, ok=False)  # connection lost mid-frame
    assert "f" in store.pop_ready()
    result = store.claim("f")
    assert result is not None and "connection lost" in (result.error or "")
    assert "stage: transferring" in (result.error or "")
