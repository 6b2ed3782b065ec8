"""The node's engine thread: the only thread that touches the engine. Other threads (the event
loop serving gRPC/HTTP) post commands to it and get outputs back through callbacks.

Lifecycle: `build` makes the engine on the thread itself -> the caller wires it -> `start`
runs the loop -> `submit`/`abort`/`call` from any thread -> `stop` fails every request still
in flight with a clear error and joins the thread. The loop steps while there is model work
and otherwise sleeps on an event that commands and connector completions set; the idle timeout
only paces the expiry sweeps (requests past their deadline, the connector's), it is not a
poll for work. After every turn the loop publishes the engine's snapshot, which other threads
read (`snapshot`) instead of engine state.

Why the engine is built here and not by the caller: torch's CPU kernels run on libgomp, which
gives every thread that enters a parallel region a thread pool of its own. An engine loaded on
one thread (e.g. the event loop's executor, which stays alive) and stepped on another leaves
two pools; libgomp then manages more threads than there are cores and stops spinning between
parallel regions, so each region ends in futex sleeps and wake-ups (thousands of voluntary
context switches per request; decode steps measurably slower, `benchmarks/engine_thread.py`).
One thread that loads, warms and steps the engine keeps one pool.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from pdserve.engine.deadlines import expired
from pdserve.engine.failure import Failure, FailureReason, RequestFailed
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loop_post import one_wakeup_per_loop
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import RequestOptions, SamplingParams
from pdserve.engine.snapshot import NodeSnapshot

logger = logging.getLogger(__name__)

T = TypeVar("T")
OutputCallback = Callable[[RequestOutput], None]
IDLE_TICK_S = 0.25
# Requests that find the engine idle are gathered for this long (and on, while more keep
# arriving, up to 4 times as long) before the first step, so that clients sending together
# (say, the next requests of a batch that just finished) start in one step. Started as they
# come, the first would be decoding while the others' prompts run, and every token of its would
# wait for a whole prompt: on the AVX512-BF16 EPYC's vs_vllm load (4 clients, 542-token
# prompts) pdserve's ITL p99 was 0.23-0.84 s where vLLM's stayed near its p50. The clients of a
# finished batch sent their next requests up to ~10 ms apart there: 5 ms split them. The
# gathering ends sooner once as many requests wait as the engine last held at once (clients
# that each send their next request when the last ends are all back): the window after the last
# of them was every such wave's TTFT for nothing.
ADMIT_WINDOW_S = 0.015


class EngineStopped(RequestFailed):
    def __init__(self) -> None:
        super().__init__(Failure(FailureReason.SHUTTING_DOWN, "the engine is stopping"))


class EngineThread:
    """Admission is decided on the engine thread, so it is atomic: `submit` refuses a request
    (OVERLOADED) when `max_pending` requests are in the engine or `max_waiting` wait to be
    scheduled."""

    def __init__(
        self,
        build: Callable[[], LLMEngine],
        name: str = "engine",
        max_pending: int | None = None,
        max_waiting: int | None = None,
        admit_window_s: float = ADMIT_WINDOW_S,
    ) -> None:
        self._build = build
        self.admit_window_s = admit_window_s
        self._engine: LLMEngine | None = None
        self.max_pending = max_pending
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._callbacks: dict[str, OutputCallback] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._peak_waiting = 0  # the most requests ever waiting at once (admission's proof)
        self._busy_peak = 0  # the most requests in the engine at once since it was last idle
        self._returning = 0  # the last busy spell's peak: a gathering of as many ends at once
        self._snapshot = NodeSnapshot()
        self._built: Future[LLMEngine] = Future()
        self._go = threading.Event()

    def build(self) -> Future[LLMEngine]:
        """Start the thread, which builds the engine and then waits for `start`; the future
        holds the engine (or the error that building raised, after which the thread ends)."""
        self._thread.start()
        return self._built

    def start(self) -> None:
        """Start the loop (after the caller has wired the built engine's connector)."""
        self._go.set()

    @property
    def engine(self) -> LLMEngine:
        """The engine (this thread only; commands run after it is built)."""
        assert self._engine is not None, "engine not built"
        return self._engine

    def wake(self) -> None:
        self._wake.set()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread; its result or exception arrives in the future."""
        fut: Future[T] = Future()
        if self._stopping:
            fut.set_exception(EngineStopped())
            return fut

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller through the future
                fut.set_exception(e)

        self._commands.put(run)
        self._wake.set()
        return fut

    def submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        on_output: OutputCallback,
        options: RequestOptions | None = None,
    ) -> Future[None]:
        def add() -> None:
            self._admit()
            self.engine.add_request(request_id, prompt, params, options)
            self._peak_waiting = max(self._peak_waiting, self.engine.num_waiting)
            self._callbacks[request_id] = on_output

        return self.call(add)

    def _admit(self) -> None:
        engine = self.engine
        full = self.max_pending is not None and len(engine.requests) >= self.max_pending
        queued = self.max_waiting is not None and engine.num_waiting >= self.max_waiting
        if full or queued:
            message = "the server is overloaded; retry later"
            raise RequestFailed(Failure(FailureReason.OVERLOADED, message, "admission"))

    def abort(self, request_id: str, failure: Failure | None = None) -> Future[None]:
        """Stop a request; with `failure`, it ends as failed for that reason."""

        def run() -> None:
            engine = self.engine
            out = engine.abort(request_id) if failure is None else engine.fail(request_id, failure)
            if out is not None:
                self._deliver(out)

        return self.call(run)

    def _take_snapshot(self) -> NodeSnapshot:
        snap = self.engine.snapshot()
        snap.num_requests_waiting_peak = self._peak_waiting
        return snap

    def snapshot(self) -> NodeSnapshot:
        """The engine's state as of the end of the last loop turn (any thread)."""
        return self._snapshot

    def deliver(self, out: RequestOutput) -> None:
        """Hand `out` to its request's callback (this thread: an output a command made)."""
        self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        cb = self._callbacks.get(out.request_id)
        if out.finished:
            self._callbacks.pop(out.request_id, None)
        if cb is not None:
            cb(out)

    def _run(self) -> None:
        try:
            self._engine = self._build()
        except BaseException as e:  # handed to `start`'s caller
            self._built.set_exception(e)
            return
        if self._engine.tp is not None:  # a rank's death wakes the loop to fail what runs
            self._engine.tp.on_broken = self.wake
        self._snapshot = self._take_snapshot()
        self._built.set_result(self._engine)
        self._go.wait()
        while not self._stopping:
            # Cleared before looking for work: a wake during this iteration is kept for the wait.
            self._wake.clear()
            try:
                # Each phase's outputs reach each event loop in one wake-up (`loop_post`); first
                # tokens from the connector go out before the step starts.
                idle = not self.engine.has_compute()
                if idle and self._busy_peak:  # a busy spell just ended
                    self._returning, self._busy_peak = self._busy_peak, 0
                with one_wakeup_per_loop():
                    self._run_commands()
                    if idle and self.engine.has_compute():
                        self._gather_arrivals()
                    for out in self.engine.poll_connector():
                        self._deliver(out)
                    self._expire()
                if self.engine.has_compute():
                    self._busy_peak = max(self._busy_peak, len(self.engine.requests))
                with one_wakeup_per_loop():
                    for out in self.engine.run_step():
                        self._deliver(out)
                    # Published before the turn's outputs reach their loops: a client that has
                    # an output never reads stats from before it (a snapshot taken after the
                    # hand-off lagged it whenever this thread was not scheduled in between).
                    self._snapshot = self._take_snapshot()
            except Exception:
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_all(
                    Failure(FailureReason.INTERNAL, "engine step failed (see the node's log)")
                )
                self._snapshot = self._take_snapshot()
            if not self.engine.has_compute() and self._commands.empty():
                self._wake.wait(IDLE_TICK_S)
        self._fail_all(Failure(FailureReason.SHUTTING_DOWN, "the node is shutting down"))
        self._snapshot = self._take_snapshot()
        self.engine.close()

    def _run_commands(self) -> None:
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _expire(self) -> None:
        """Fail the requests whose deadline passed (their blocks are freed)."""
        for request_id, failure in expired(self.engine.requests.values(), time.time()):
            logger.info("request %s: %s (%s)", request_id, failure.message, failure.stage)
            out = self.engine.fail(request_id, failure)
            if out is not None:
                self._deliver(out)

    def _gather_arrivals(self) -> None:
        """Work arrived at an idle engine: take in what arrives with it (ADMIT_WINDOW_S), until
        as many requests are in as the last busy spell held at once."""
        deadline = time.monotonic() + 4 * self.admit_window_s
        while not self._stopping:
            wait = min(self.admit_window_s, deadline - time.monotonic())
            if wait <= 0 or 0 < self._returning <= len(self.engine.requests):
                return
            self._wake.clear()
            if self._commands.empty() and not self._wake.wait(wait):
                return  # nothing more came within the window
            self._run_commands()

    def _fail_all(self, failure: Failure) -> None:
        if self._engine is None:
            return
        for request_id in list(self.engine.requests):
            out = self.engine.fail(request_id, failure)
            if out is not None:
                self._deliver(out)

    def stop(self, timeout: float = 10.0) -> None:
        """Fail requests in flight, stop the loop and join it. Safe if never started."""
        self._stopping = True
        self._wake.set()
        self._go.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        while True:  # commands that arrived after the loop ended
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                break
