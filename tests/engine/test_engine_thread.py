"""The engine thread gathers requests that find the engine idle: those arriving within its
admission window start in one step (clients sending together stay in step with each other),
and one arriving after the window has its own step."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import SamplingParams
from tests.helpers import make_engine, make_tiny_model


def run_arrivals(tmp_path: Path, window_s: float, gaps_s: list[float]) -> int:
    """Submit one prompt (one output token each) after each gap; the engine's forward steps."""
    engine = make_engine(make_tiny_model(tmp_path / "tiny"))
    thread = EngineThread(lambda: engine, "test-engine", admit_window_s=window_s)
    thread.build().result(60)
    thread.start()
    finished = threading.Semaphore(0)

    def on_output(out: RequestOutput) -> None:
        if out.finished:
            finished.release()

    try:
        steps = engine.scheduler.stats.num_steps
        for i, gap in enumerate(gaps_s):
            time.sleep(gap)
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            thread.submit(f"r{i}", [5 + i, 6, 7, 8, 9], params, on_output)
        for _ in gaps_s:
            assert finished.acquire(timeout=30), "a request did not finish"
        return engine.scheduler.stats.num_steps - steps
    finally:
        thread.stop()


def test_requests_arriving_together_at_an_idle_engine_start_in_one_step(tmp_path: Path) -> None:
    # 40 ms apart: without the gathering the first would run alone (a step here takes ~ms)
    assert run_arrivals(tmp_path, window_s=0.5, gaps_s=[0.0, 0.04, 0.04, 0.04]) == 1


def test_a_request_after_the_window_has_its_own_step(tmp_path: Path) -> None:
    assert run_arrivals(tmp_path, window_s=0.01, gaps_s=[0.0, 1.0]) == 2
