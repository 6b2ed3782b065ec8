"""Continuous batching: every step schedules running requests first (one decode token, or the
next chunk of an unfinished prompt) and then admits waiting ones while the token budget, the
sequence limit and the free blocks allow. When blocks run out, the most recently admitted
request is preempted by recompute: its blocks are freed and it returns to the front of the
queue, to be recomputed (its prefix often still cached) and finish with the same output.
Plain Python, no torch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.engine.kv_manager import KVCacheManager
from pdserve.engine.sequence import Milestone, Sampled, Sequence, SequenceStatus

SMALL_REMAINDER = 8  # a prompt's last chunk under budget / this is taken with the rest (_chunk)


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # True when this step computes the request's last known token, so a new one is sampled.
    sample: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Admitted with blocks allocated, now WAITING_FOR_KV: the engine starts their remote prefill.
    remote_started: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class SchedulerStats:
    num_steps: int = 0  # forward passes applied (`update` calls): the engine's clock
    num_preemptions: int = 0
    num_partial_prefills: int = 0  # scheduled prompt chunks that did not reach the prompt's end
    prompt_tokens: int = 0  # tokens of admitted requests
    cached_prompt_tokens: int = 0  # of those, served from the prefix cache


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        hold_blocks: Callable[[Sequence], bool] = lambda seq: False,
        keep_remote: Callable[[Sequence, int], bool] = lambda seq, backlog: True,
    ) -> None:
        self.config = config
        self.stats = SchedulerStats()
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.waiting_for_kv: dict[str, Sequence] = {}
        # Finished requests whose blocks a connector still reads (a send in flight).
        self.held: dict[str, Sequence] = {}
        self.hold_blocks = hold_blocks
        # Asked once a request planned for a remote prefill holds its blocks (its cached prefix
        # known), with the prompt tokens still to compute here before it: whether it still goes
        # remote.
        self.keep_remote = keep_remote

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv)

    @property
    def has_compute(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        prompt_tokens = 0  # of prompts (chunks) in this step
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            n = max(1, self.kv.fit_window(seq, n))  # a prompt's chunk: as window parts allow
            if not self._make_room(seq, n, out):
                break  # `seq` itself was preempted (it was the last running request)
            if seq.num_computed_tokens + 1 < seq.num_tokens:  # a prompt's chunk, not a decode
                prompt_tokens += n
            self.kv.append(seq, n)
            out.scheduled.append(self._scheduled(seq, n))
            budget -= n
            i += 1
        if out.preempted:
            return out  # memory is short: do not admit anything new this step
        deferred: list[Sequence] = []
        step_limit = self.config.prefill_step_tokens
        while self.waiting and budget > 0 and self._num_active < self.config.max_num_seqs:
            if step_limit is not None and prompt_tokens >= step_limit:
                break  # the step holds enough prompt: the next one goes first next step
            seq = self.waiting[0]
            if self._waits_for_parent(seq):
                deferred.append(self.waiting.popleft())  # later requests may go first
                continue
            if not self.kv.can_allocate(seq):
                break
            self.waiting.popleft()
            seq.timings.setdefault(Milestone.SCHEDULED, time.time())
            self.kv.allocate(seq)
            if seq.remote_prefill and not self.keep_remote(seq, self.prefill_backlog()):
                seq.remote_prefill = False  # what is left to compute is computed here
                self.kv.compute_here(seq)
            n = 0 if seq.remote_prefill else self.kv.fit_window(seq, self._chunk(seq, budget))
            if not (seq.remote_prefill or n and self.kv.can_append(seq, n)):
                self.kv.free(seq)  # window parts short (computed here after all): later
                self.waiting.appendleft(seq)
                break
            self.stats.prompt_tokens += seq.num_tokens
            self.stats.cached_prompt_tokens += seq.num_cached_tokens
            if seq.remote_prefill:
                seq.status = SequenceStatus.WAITING_FOR_KV
                self.waiting_for_kv[seq.request_id] = seq
                out.remote_started.append(seq)
                continue
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.kv.append(seq, n)
            out.scheduled.append(self._scheduled(seq, n))
            budget -= n
            prompt_tokens += n
        self.waiting.extendleft(reversed(deferred))
        return out

    def prefill_backlog(self) -> int:
        """Prompt tokens the running requests still have to compute here."""
        return sum(
            s.num_tokens - s.num_computed_tokens
            for s in self.running
            if s.num_computed_tokens < s.num_prompt_tokens
        )

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """How many of `seq`'s uncomputed tokens this step takes: what the budget leaves, or
        all of them where fewer than an eighth of the whole budget would be left over. A small
        last chunk would cost every decoding stream a step's wait for little work: 4 clients
        sending 542-token prompts together left 120 tokens of the fourth for a second step with
        a 2048-token budget, a 0.2 s gap in the other three streams. The step overshoots the
        budget by at most that eighth (the loops stop once it is spent)."""
        left = seq.num_tokens - seq.num_computed_tokens
        if left - budget <= self.config.max_num_batched_tokens // SMALL_REMAINDER:
            return left
        return budget

    @staticmethod
    def _waits_for_parent(seq: Sequence) -> bool:
        """Whether `seq`'s parent (same prompt) has yet to put its prompt's KV in the cache."""
        parent = seq.parent
        if parent is None:
            return False
        if not parent.status.finished and parent.num_computed_tokens < parent.num_prompt_tokens:
            return True  # waiting, its KV arriving, or its prompt computed in chunks
        seq.parent = None  # computed (or finished, or failed): admit on the cache as it is
        return False

    @property
    def _num_active(self) -> int:
        return len(self.running) + len(self.waiting_for_kv)

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledSeq:
        sample = seq.num_computed_tokens + n == seq.num_tokens
        self.stats.num_partial_prefills += not sample
        return ScheduledSeq(seq, n, sample)

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Preempt from the back of the running list until `seq` can grow by `n` tokens."""
        while not self.kv.can_append(seq, n):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.remote_prefill = False  # recomputed here, prompt and output alike
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(
        self, out: SchedulerOutput, sampled: dict[str, Sampled], eos_ids: Iterable[int]
    ) -> list[Sequence]:
        """Apply a finished step: advance computed counts, register full blocks for reuse,
        append sampled tokens and finish requests that hit a stop condition."""
        eos = frozenset(eos_ids)
        self.stats.num_steps += 1
        finished: list[Sequence] = []
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            self.kv.register_computed(seq)
            if not s.sample:
                continue
            chosen = sampled[seq.request_id]
            self.append_token(seq, chosen)
            status = self.stop_status(seq, chosen.token, eos)
            if status is not None:
                self.finish(seq, status)
                finished.append(seq)
        return finished

    @staticmethod
    def append_token(seq: Sequence, chosen: Sampled) -> None:
        if not seq.output_token_ids:
            seq.timings.setdefault(Milestone.FIRST_TOKEN, time.time())
        seq.output_token_ids.append(chosen.token)
        if seq.params.logprobs:
            seq.output_logprobs.append(chosen.logprob)
            if seq.params.top_logprobs:
                seq.output_top_logprobs.append(chosen.top)

    def stop_status(self, seq: Sequence, token: int, eos: frozenset[int]) -> SequenceStatus | None:
        p = seq.params
        if (not p.ignore_eos and token in eos) or token in p.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def prefill_locally(self, seq: Sequence) -> None:
        """A remote prefill could not start (every prefill node overloaded): `seq` keeps its
        blocks and computes its prompt here, like a request that was never split."""
        del self.waiting_for_kv[seq.request_id]
        seq.remote_prefill = False
        self.kv.compute_here(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def complete_remote_prefill(self, seq: Sequence, first: Sampled, eos: frozenset[int]) -> None:
        """The prompt's KV arrived in `seq`'s blocks and its first token was sampled remotely:
        `seq` joins the decode batch (or finishes if that token already stops it)."""
        del self.waiting_for_kv[seq.request_id]
        seq.num_computed_tokens = seq.num_tokens
        self.kv.register_computed(seq)
        self.append_token(seq, first)
        status = self.stop_status(seq, first.token, eos)
        if status is not None:
            seq.status = SequenceStatus.RUNNING  # so that finish() accepts it
            self.finish(seq, status)
            return
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def resume_computed(self, seq: Sequence, num_computed: int) -> None:
        """The KV of `seq`'s first `num_computed` tokens arrived in its blocks (a stream
        migrated here): it computes the rest here, from the next step."""
        del self.waiting_for_kv[seq.request_id]
        seq.num_computed_tokens = num_computed
        self.kv.register_computed(seq)
        seq.remote_prefill = False
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def can_migrate(self, seq: Sequence) -> bool:
        """Whether `seq` is between two decode steps: every token but its last one computed
        (its next step would compute that one and sample another)."""
        return (
            seq in self.running
            and bool(seq.output_token_ids)
            and seq.num_computed_tokens == seq.num_tokens - 1
        )

    def pause(self, seq: Sequence) -> None:
        """End `seq` here as migrated, holding its blocks (with their KV) until
        `release_held`: another node fetches them and goes on with it."""
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED_MIGRATED
        self.held[seq.request_id] = seq

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Remove `seq` wherever it is and free its blocks, unless `hold_blocks` keeps them
        until `release_held`. Safe to call twice."""
        if seq.status.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.waiting_for_kv.pop(seq.request_id, None)
        seq.status = status
        if seq.block_table:
            if self.hold_blocks(seq):
                self.held[seq.request_id] = seq
            else:
                self.kv.free(seq)

    def release_held(self, request_id: str) -> None:
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)
