"""The engine thread gathers requests that find the engine idle: those arriving within its
admission window start in one step (clients sending together stay in step with each other;
once as many are back as it last held, at once), and one arriving after the window has its own
step."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import SamplingParams
from tests.helpers import make_engine, make_tiny_model


class Started:
    """A tiny model's engine on a started engine thread with this admission window."""

    def __init__(self, tmp_path: Path, window_s: float) -> None:
        self.engine = make_engine(make_tiny_model(tmp_path / "tiny"))
        self.thread = EngineThread(lambda: self.engine, "test-engine", admit_window_s=window_s)
        self.thread.build().result(60)
        self.thread.start()
        self.finished = threading.Semaphore(0)

    def submit(self, i: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.thread.submit(f"r{i}", [5 + i, 6, 7, 8, 9], params, self.on_output)

    def on_output(self, out: RequestOutput) -> None:
        if out.finished:
            self.finished.release()

    def wait(self, count: int) -> None:
        for _ in range(count):
            assert self.finished.acquire(timeout=30), "a request did not finish"

    def steps(self) -> int:
        return self.engine.scheduler.stats.num_steps


def run_arrivals(tmp_path: Path, window_s: float, gaps_s: list[float]) -> int:
    """Submit one prompt (one output token each) after each gap; the engine's forward steps."""
    node = Started(tmp_path, window_s)
    try:
        steps = node.steps()
        for i, gap in enumerate(gaps_s):
            time.sleep(gap)
            node.submit(i, max_tokens=1)
        node.wait(len(gaps_s))
        return node.steps() - steps
    finally:
        node.thread.stop()


def test_requests_arriving_together_at_an_idle_engine_start_in_one_step(tmp_path: Path) -> None:
    # 40 ms apart: without the gathering the first would run alone (a step here takes ~ms)
    assert run_arrivals(tmp_path, window_s=0.5, gaps_s=[0.0, 0.04, 0.04, 0.04]) == 1


def test_a_request_after_the_window_has_its_own_step(tmp_path: Path) -> None:
    assert run_arrivals(tmp_path, window_s=0.01, gaps_s=[0.0, 1.0]) == 2


def test_a_gathering_ends_once_as_many_are_back_as_the_engine_last_held(tmp_path: Path) -> None:
    """Clients that send their next requests when the last end: once all 4 are back the step
    starts, without waiting out the window after the last (here 2 s; a step takes ~ms); a wave
    of fewer than were held still waits for the others within the window."""
    window_s = 2.0
    node = Started(tmp_path, window_s)

    def wave(first: int, count: int) -> float:
        """Submit `count` prompts at once; seconds until all have finished."""
        start = time.monotonic()
        for i in range(first, first + count):
            node.submit(i, max_tokens=2)
        node.wait(count)
        return time.monotonic() - start

    try:
        steps = node.steps()
        assert wave(0, 4) >= window_s  # the first wave: nothing held before, the whole window
        first_steps = node.steps() - steps
        assert wave(4, 4) < window_s / 2  # all 4 back: no window after the last
        assert node.steps() - steps == 2 * first_steps  # in one step each
        assert wave(8, 3) >= window_s  # 3 of the 4 back: the window waits for a fourth
    finally:
        node.thread.stop()
