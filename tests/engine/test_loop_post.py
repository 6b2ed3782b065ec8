"""Hand-offs from the engine thread to an event loop (`loop_post`): the outputs of one engine
step reach a loop in one wake-up, not one per request, every output arrives and in order; a
`post` outside an engine turn goes at once; a closed loop still raises, after the other loops
got their batches."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.loop_post import one_wakeup_per_loop, post
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import SamplingParams
from tests.helpers import make_engine, make_tiny_model


class CountedLoop:
    """A real event loop on its own thread, counting the thread-safe calls that wake it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.wakeups = 0
        call = self.loop.call_soon_threadsafe

        def counted(fn: Callable[..., Any], *args: Any) -> Any:
            self.wakeups += 1
            return call(fn, *args)

        self.loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def counted() -> Iterator[CountedLoop]:
    c = CountedLoop()
    yield c
    c.close()


def test_one_step_reaches_a_loop_in_one_wakeup(tmp_path: Path, counted: CountedLoop) -> None:
    engine = make_engine(make_tiny_model(tmp_path / "tiny"))
    thread = EngineThread(lambda: engine, "test-engine")
    thread.build().result(60)
    thread.start()
    received: dict[str, list[RequestOutput]] = {}
    done = threading.Event()
    try:

        def record(rid: str, out: RequestOutput) -> None:  # on the loop's thread
            received.setdefault(rid, []).append(out)
            if sum(o.finished for outs in received.values() for o in outs) == 4:
                done.set()

        steps = engine.scheduler.stats.num_steps
        for i in range(4):
            rid, params = f"r{i}", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            on_output = lambda out, r=rid: post(counted.loop, record, r, out)  # noqa: E731
            thread.submit(rid, [5 + i, 6, 7, 8], params, on_output).result(10)
        assert done.wait(30), "not every request finished"
        steps = engine.scheduler.stats.num_steps - steps
    finally:
        thread.stop()
    for outs in received.values():
        lengths = [len(o.token_ids) for o in outs]
        assert lengths == list(range(1, 13)) and outs[-1].finished  # all of them, in order
    assert sum(len(outs) for outs in received.values()) == 4 * 12
    assert counted.wakeups <= steps < 4 * 12  # one per step, not one per request and step


def test_outside_a_turn_a_post_goes_at_once(counted: CountedLoop) -> None:
    got = threading.Event()
    post(counted.loop, got.set)
    assert got.wait(10)
    assert counted.wakeups == 1


def test_a_closed_loop_raises_after_the_others_got_their_batch(counted: CountedLoop) -> None:
    closed = asyncio.new_event_loop()
    closed.close()
    got: list[int] = []
    delivered = threading.Event()
    with pytest.raises(RuntimeError), one_wakeup_per_loop():
        post(closed, got.append, 0)
        post(counted.loop, got.append, 1)
        post(counted.loop, got.append, 2)
        post(counted.loop, delivered.set)
    assert delivered.wait(10)
    assert got == [1, 2] and counted.wakeups == 1
