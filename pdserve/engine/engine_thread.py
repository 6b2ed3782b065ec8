"""The node's engine thread: the only thread that touches the engine. Other threads (the event
loop serving gRPC/HTTP) post commands to it and get outputs back through callbacks.

Lifecycle: `start` -> `submit`/`abort`/`call` from any thread -> `stop` fails every request
still in flight with a clear error and joins the thread. The loop steps while there is model
work and otherwise sleeps on an event that commands and connector completions set; the idle
timeout only paces the connector's expiry sweeps, it is not a poll for work. After every turn
the loop publishes the engine's snapshot, which other threads read (`snapshot`) instead of
engine state.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from pdserve.engine.failure import Failure, FailureReason, RequestFailed
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import RequestOptions, SamplingParams
from pdserve.engine.snapshot import NodeSnapshot

logger = logging.getLogger(__name__)

T = TypeVar("T")
OutputCallback = Callable[[RequestOutput], None]
IDLE_TICK_S = 0.25


class EngineStopped(RequestFailed):
    def __init__(self) -> None:
        super().__init__(Failure(FailureReason.SHUTTING_DOWN, "the engine is stopping"))


class EngineThread:
    """Admission is decided on the engine thread, so it is atomic: `submit` refuses a request
    (OVERLOADED) when `max_pending` requests are in the engine or `max_waiting` wait to be
    scheduled."""

    def __init__(
        self,
        engine: LLMEngine,
        name: str = "engine",
        max_pending: int | None = None,
        max_waiting: int | None = None,
    ) -> None:
        self.engine = engine
        self.max_pending = max_pending
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._callbacks: dict[str, OutputCallback] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._peak_waiting = 0  # the most requests ever waiting at once (admission's proof)
        self._snapshot = engine.snapshot()

    def start(self) -> None:
        self._thread.start()

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
        snap.gauges["num_requests_waiting_peak"] = self._peak_waiting
        return snap

    def snapshot(self) -> NodeSnapshot:
        """The engine's state as of the end of the last loop turn (any thread)."""
        return self._snapshot

    def _deliver(self, out: RequestOutput) -> None:
        cb = self._callbacks.get(out.request_id)
        if out.finished:
            self._callbacks.pop(out.request_id, None)
        if cb is not None:
            cb(out)

    def _run(self) -> None:
        while not self._stopping:
            # Cleared before looking for work: a wake during this iteration is kept for the wait.
            self._wake.clear()
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            try:
                for out in self.engine.poll_connector():  # first tokens go out before a step
                    self._deliver(out)
                for out in self.engine.run_step():
                    self._deliver(out)
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

    def _fail_all(self, failure: Failure) -> None:
        for request_id in list(self.engine.requests):
            out = self.engine.fail(request_id, failure)
            if out is not None:
                self._deliver(out)

    def stop(self, timeout: float = 10.0) -> None:
        """Fail requests in flight, stop the loop and join it. Safe if never started."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        while True:  # commands that arrived after the loop ended
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                break
