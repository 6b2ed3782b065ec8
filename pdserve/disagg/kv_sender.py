"""Prefill side of a transfer: the engine connector that pushes each layer's KV to decode as
soon as that layer is computed, while the next layers still compute.

Lifecycle of a send (per request, keyed by request id = the handoff's unique key):
`add_target` (decode's blocks, blocks to skip, deadline) -> the engine schedules the prompt ->
in the step that completes it, `layer_hook` submits one batched write per layer as the layer's
ready event is recorded -> the request finishes after its first token; `request_finished`
holds its blocks while writes are in flight -> the last write's completion hands the blocks
back (`poll_finished_sends`) and reports the outcome (first token or error) through
`on_complete`, exactly once. An abort cancels queued writes and still waits for the one being
sent before the blocks are freed (the transport bounds that wait by the request's deadline).
A target still here after its deadline is swept: its writes are cancelled, or, if the engine
dropped the request without ever holding blocks for it, its outcome is reported as failed.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.disagg.send_target import Complete, PrefillOutcome, SendTarget
from pdserve.disagg.transport.base import (
    LayerWrite,
    TransferSender,
    TransportError,
)
from pdserve.disagg.transport.events import AsyncEvent, CompletedEvent
from pdserve.disagg.wire import frame_block_bytes
from pdserve.engine.connector import KVConnector
from pdserve.engine.failure import Failure, FailureReason, RequestFailed
from pdserve.engine.kv_manager import first_block_sent
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.sequence import Milestone, Sequence, SequenceStatus
from pdserve.engine.snapshot import NodeSnapshot
from pdserve.model.layers import LayerDone

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 0.25
SWEEP_GRACE_S = 1.0  # past the deadline, for the prefill call's own timer to act first


@dataclass
class _SendState:
    target: SendTarget
    on_complete: Complete
    outcome: PrefillOutcome
    pending: int = 0  # writes submitted and not yet completed
    submitted: bool = False
    finished: bool = False  # the engine is done with the request
    reported: bool = False


class KVSender(KVConnector):
    def __init__(
        self,
        sender: TransferSender,
        num_layers: int,
        block_size: int,
        wake: Callable[[], None] = lambda: None,
        event_factory: Callable[[], AsyncEvent] = CompletedEvent,
        windows: tuple[int | None, ...] = (),
    ) -> None:
        """`windows`: each layer's sliding window (`kv_cache.layer_windows`; empty: none)."""
        self.sender = sender
        self.num_layers = num_layers
        self.block_size = block_size
        self.windows = windows or (None,) * num_layers
        self.wake = wake
        self.event_factory = event_factory
        self._lock = threading.Lock()
        self._states: dict[str, _SendState] = {}
        self._done: deque[str] = deque()
        self._last_sweep = 0.0
        self.failures: dict[str, int] = {}

    # ---- called on the engine thread ----------------------------------------------------

    def add_target(self, target: SendTarget, on_complete: Complete) -> None:
        with self._lock:
            if target.unique_key in self._states:
                message = f"unique key {target.unique_key} is already being prefilled"
                raise RequestFailed(Failure(FailureReason.DUPLICATE, message, "admission"))
            outcome = PrefillOutcome(num_skipped_blocks=target.num_skipped)
            self._states[target.unique_key] = _SendState(target, on_complete, outcome)

    def remove_target(self, unique_key: str) -> None:
        """Forget a target whose request never reached the engine."""
        with self._lock:
            self._states.pop(unique_key, None)

    def layer_hook(self, out: SchedulerOutput) -> LayerDone | None:
        sends: list[tuple[Sequence, _SendState]] = []
        with self._lock:
            for s in out.scheduled:
                state = self._states.get(s.seq.request_id)
                if s.sample and state is not None and not state.submitted:
                    state.submitted = True
                    state.pending = self.num_layers * len(state.target.heads)
                    state.outcome.num_prefill_cached_tokens = s.seq.num_cached_tokens
                    sends.append((s.seq, state))
        if not sends:
            return None
        for seq, _ in sends:
            # Frames carry whole blocks: the slots of the last block past the prompt's end
            # still hold an earlier request's KV. Cleared before this step writes the prompt's
            # own slots, so nothing of another request ever leaves this node.
            used = seq.num_prompt_tokens % self.block_size
            if used:
                last = seq.block_table[(seq.num_prompt_tokens - 1) // self.block_size]
                self.sender.regions.clear_tail(last, used)

        def layer_done(layer: int) -> None:
            event = self.event_factory()
            for seq, state in sends:
                self._submit(
                    state.target, seq.block_table[: len(state.target.dst_blocks)], layer, event
                )

        return layer_done

    def _submit(self, t: SendTarget, blocks: list[int], layer: int, event: AsyncEvent) -> None:
        """`blocks` (the prompt's, here) of `layer` to the target, past the blocks it skips
        and, for a windowed layer, the blocks behind its window: one write per head range of
        the target's split."""
        first = t.num_skipped
        if t.num_tokens:
            window = self.windows[layer]
            first = max(first, first_block_sent(window, t.num_tokens, self.block_size))
        src = blocks[first:]
        for head_start, head_count in t.heads:
            nbytes = len(src) * frame_block_bytes(self.sender.regions, head_count)
            self.sender.submit(
                LayerWrite(
                    peer=t.peer,
                    unique_key=t.unique_key,
                    layer=layer,
                    src_blocks=src,
                    dst_blocks=t.dst_blocks[first:],
                    deadline=t.deadline,
                    done=functools.partial(self._write_done, t.unique_key, layer, nbytes),
                    event=event,
                    head_start=head_start,
                    head_count=head_count,
                )
            )

    def send_computed(
        self, target: SendTarget, blocks: list[int], filled: int, on_complete: Complete
    ) -> None:
        """Send KV already in `blocks` (a paused stream's, a live migration), every layer now,
        with no first token; the outcome is reported once the last write is out (through
        `poll_finished_sends`, which `wake` must lead to). Only the first `filled` slots of
        the last block hold that stream's KV: the rest are cleared first, so nothing of
        another request leaves this node."""
        self.add_target(target, on_complete)
        with self._lock:
            state = self._states[target.unique_key]
            state.submitted = state.finished = True
            state.pending = self.num_layers * len(target.heads)
        if filled < self.block_size:
            self.sender.regions.clear_tail(blocks[-1], filled)
        event = CompletedEvent()
        for layer in range(self.num_layers):
            self._submit(target, blocks, layer, event)

    def cancel(self, unique_key: str, failure: Failure) -> None:
        """Stop sending `unique_key` now (any thread): queued writes complete with an error
        and the blocks are handed back once the write in flight, if any, is out."""
        with self._lock:
            state = self._states.get(unique_key)
            if state is None:
                return
            if state.outcome.failure is None:
                state.outcome.failure = failure
            self.sender.cancel(unique_key)

    def progress(self, unique_key: str) -> str:
        """Where a send stands, for the log of a request that failed."""
        with self._lock:
            state = self._states.get(unique_key)
            if state is None:
                return "no send in progress"
            computed = "computed" if state.finished else "not computed"
            submitted = "submitted" if state.submitted else "not submitted"
            return f"prompt {computed}, layers {submitted}, {state.pending} writes unacknowledged"

    def fail_all(self, failure: Failure) -> None:
        with self._lock:
            keys = list(self._states)
        for key in keys:
            self.cancel(key, failure)

    def request_finished(self, seq: Sequence) -> bool:
        with self._lock:
            state = self._states.get(seq.request_id)
            if state is None:
                return False
            state.finished = True
            state.outcome.scheduled_at = seq.timings.get(Milestone.SCHEDULED, 0.0)
            state.outcome.computed_at = time.time()
            if seq.output_token_ids:
                state.outcome.has_first_token = True
                state.outcome.first_token = seq.output_token_ids[0]
                state.outcome.first_logprob = seq.output_logprobs[0] if seq.output_logprobs else 0.0
                if seq.output_top_logprobs:
                    state.outcome.first_top = seq.output_top_logprobs[0]
            # A first token that is EOS or a stop token ends the request as "stop": success too.
            succeeded = seq.status in (
                SequenceStatus.FINISHED_LENGTH,
                SequenceStatus.FINISHED_STOPPED,
            )
            if not (succeeded and seq.output_token_ids) and state.outcome.failure is None:
                state.outcome.failure = seq.failure or Failure(
                    FailureReason.CANCELLED
                    if seq.status == SequenceStatus.FINISHED_ABORTED
                    else FailureReason.INTERNAL,
                    f"prefill ended as {seq.status.value}",
                    "prefill",
                )
            hold = state.pending > 0
            if hold and state.outcome.failure is not None:
                self.sender.cancel(state.target.unique_key)
            if not hold:
                self._report_locked(state)
        return hold

    def poll_finished_sends(self) -> list[str]:
        with self._lock:
            keys = list(self._done)
            self._done.clear()
            for key in keys:
                state = self._states.get(key)
                if state is not None:
                    self._report_locked(state)
            self._sweep_locked()
        return keys

    def _sweep_locked(self) -> None:
        now = time.time()
        if now - self._last_sweep < SWEEP_INTERVAL_S:
            return
        self._last_sweep = now
        for key, state in list(self._states.items()):
            if now < state.target.deadline + SWEEP_GRACE_S:
                continue
            if state.outcome.failure is None:
                message = "deadline passed"
                state.outcome.failure = Failure(FailureReason.DEADLINE, message, "prefill/transfer")
            if state.pending:
                self.sender.cancel(key)  # queued writes end now, the one in flight by deadline
            elif not state.finished:
                logger.warning("request %s: dropping its expired send", state.target.request_id)
                self._report_locked(state)

    def _report_locked(self, state: _SendState) -> None:
        key = state.target.unique_key
        self._states.pop(key, None)
        self.sender.forget(key)
        if state.reported:
            return
        state.reported = True
        failure = state.outcome.failure
        if failure is not None:
            label = failure.reason.value
            self.failures[label] = self.failures.get(label, 0) + 1
            self.sender.send_failure(state.target.peer, key, failure)
        state.on_complete(state.outcome)

    # ---- called on sender threads -------------------------------------------------------

    def _write_done(
        self, unique_key: str, layer: int, nbytes: int, error: TransportError | None
    ) -> None:
        with self._lock:
            state = self._states.get(unique_key)
            if state is None:
                return
            state.pending -= 1
            if error is not None and state.outcome.failure is None:
                state.outcome.failure = error.failure
                logger.warning("request %s: %s", state.target.request_id, error)
                self.sender.cancel(unique_key)  # skip this request's remaining layers
            elif error is None:
                state.outcome.bytes_sent += nbytes
                if layer == self.num_layers - 1:
                    state.outcome.last_layer_sent_at = time.time()
            if state.pending == 0 and state.finished:
                self._done.append(unique_key)
                self.wake()

    def add_stats(self, snapshot: NodeSnapshot) -> None:
        with self._lock:
            snapshot.pending_transfers = len(self._states)
            snapshot.transfer_failures = dict(self.failures)
        snapshot.transfer_bytes = {"sent": self.sender.bytes_sent}
        snapshot.transfer_links = {"opened": self.sender.links_opened}
