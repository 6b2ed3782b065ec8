"""The live correctness canary (`--canary-rate R`): a sampled fraction of the requests a node
completes is computed again on the node itself, colocated, when it has nothing else to do, and
compared token by token with what was served. Under `--deterministic` the two must be the same
bits (tokens and logprobs); otherwise tokens must agree up to the first difference, and there
the served token must be among the recomputation's five most likely (vLLM's criterion for bf16
models). A mismatch is logged naming the request and counted; `results` counts every check by
outcome (match, mismatch, yielded: dropped for a user request, skipped: the queue was full).

Only greedy and seeded requests are checked (an unseeded sample has nothing to compare with),
single choices (not one of n), requests that completed (length or stop). The canary never
delays a user request: one starts only when no user request is running or waiting, and one
that runs when a user request arrives is aborted and counted as yielded. At most `MAX_QUEUED`
wait, each holding its prompt and output token ids only."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import RequestOptions, SamplingParams, Sequence, SequenceStatus

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

MAX_QUEUED = 16
PREFIX = "canary-"
TOP = 5  # the recomputation's alternatives the served token may be among (not deterministic)


@dataclass(frozen=True)
class CanaryJob:
    request_id: str  # the served request's
    prompt: list[int]
    params: SamplingParams
    tokens: list[int]  # what was served
    logprobs: list[float]  # served logprobs (empty if the request did not ask)
    cache_salt: str | None


class Canary:
    def __init__(self, rate: float, exact: bool, seed: int = 0) -> None:
        self.rate = rate
        self.exact = exact  # --deterministic: the same bits or a mismatch
        self._draw = random.Random(seed)
        self._queue: deque[CanaryJob] = deque()
        self.running: tuple[str, CanaryJob] | None = None  # (canary request id, its job)
        self._ids = 0
        self._ids_out: set[str] = set()  # checks whose outputs are still to be dropped
        self.results: dict[str, int] = {}

    def owns(self, request_id: str) -> bool:
        return request_id in self._ids_out

    # ---- the engine's side ------------------------------------------------------------

    def turn(self, engine: LLMEngine) -> None:
        """Before a step: a running check gives way to a user request that waits; a queued
        one starts if the engine has nothing else to do."""
        sched = engine.scheduler
        user_work = bool(sched.waiting) or any(not self.owns(s.request_id) for s in sched.running)
        if self.running is not None and sched.waiting:
            request_id = self.running[0]
            self.yielded()
            engine.abort(request_id)
        elif self.ready(user_work):
            started = self.next()
            assert started is not None
            request_id, job, options = started
            engine.add_request(request_id, job.prompt, job.params, options)

    def user_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`outputs` without the checks' (which reach no one)."""
        kept = [o for o in outputs if not self.owns(o.request_id)]
        # A check that ended gave its last output in this step: forget it now.
        self._ids_out &= {self.running[0]} if self.running is not None else set()
        return kept

    def released(self, seq: Sequence) -> bool:
        """A request ended: checked if it was the running check, offered if a user's; True if
        it was a check (not counted as a user request)."""
        if self.running is not None and self.running[0] == seq.request_id:
            self.check(seq)
            return True
        if self.owns(seq.request_id):  # a check that gave way
            return True
        self.offer(seq)
        return False

    # ---- the checks ---------------------------------------------------------------------

    def _count(self, result: str) -> None:
        self.results[result] = self.results.get(result, 0) + 1

    def offer(self, seq: Sequence) -> None:
        """A user request ended: queue it for a check if it is drawn and checkable."""
        p = seq.params
        if (
            seq.status not in (SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_STOPPED)
            or (p.temperature > 0 and p.seed is None)
            or seq.options.after is not None
            or p.guide is not None
            or self._draw.random() >= self.rate
        ):
            return
        if len(self._queue) >= MAX_QUEUED:
            self._count("skipped")
            return
        logprobs = list(seq.output_logprobs) if p.logprobs else []
        # The same sampling (stops included: they end it where they ended the served one),
        # asking for the logprobs the comparison reads, and no more tokens than were served.
        params = dataclasses.replace(
            p,
            logprobs=True,
            top_logprobs=max(p.top_logprobs, TOP),
            max_tokens=len(seq.output_token_ids),
        )
        job = CanaryJob(
            seq.request_id,
            list(seq.prompt_token_ids),
            params,
            list(seq.output_token_ids),
            logprobs,
            seq.options.cache_salt,
        )
        self._queue.append(job)

    def ready(self, user_work: bool) -> bool:
        """Whether a check could start now (one is queued and nothing else is to be done)."""
        return bool(self._queue) and self.running is None and not user_work

    def next(self) -> tuple[str, CanaryJob, RequestOptions] | None:
        """The check to add as a request now (prefilled here, never split), or None."""
        if not self._queue or self.running is not None:
            return None
        job = self._queue.popleft()
        self._ids += 1
        request_id = f"{PREFIX}{self._ids}-{job.request_id}"
        self.running = (request_id, job)
        self._ids_out.add(request_id)
        return request_id, job, RequestOptions(allow_split=False, cache_salt=job.cache_salt)

    def yielded(self) -> None:
        """The running check was aborted for user work (its job is dropped, not retried: the
        node is busy, and another completed request will be drawn)."""
        self.running = None
        self._count("yielded")

    def check(self, seq: Sequence) -> None:
        """The running check ended: compare it with what was served."""
        assert self.running is not None and self.running[0] == seq.request_id
        job = self.running[1]
        self.running = None
        if seq.status not in (SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_STOPPED):
            self._count("failed")
            return
        problem = self._difference(job, seq)
        if problem is None:
            self._count("match")
            return
        self._count("mismatch")
        logger.error("canary: request %s served output the model does not give: %s",
                     job.request_id, problem)  # fmt: skip

    def _difference(self, job: CanaryJob, seq: Sequence) -> str | None:
        tokens = list(seq.output_token_ids)
        first = _first_difference(job.tokens, tokens)
        if first is not None and first >= min(len(job.tokens), len(tokens)):
            return f"served {len(job.tokens)} tokens, recomputed {len(tokens)}"
        if self.exact:
            if first is not None:
                return f"token {first}: served {job.tokens[first]}, recomputed {tokens[first]}"
            logprobs = list(seq.output_logprobs)
            at = _first_difference(job.logprobs, logprobs) if job.logprobs else None
            if at is not None:
                return f"logprob {at}: served {job.logprobs[at]!r}, recomputed {logprobs[at]!r}"
            return None
        if first is None:
            return None
        alternatives = [t for t, _ in seq.output_top_logprobs[first]][:TOP]
        if job.tokens[first] in alternatives:
            return None
        return (
            f"token {first}: served {job.tokens[first]}, not among the recomputation's "
            f"{TOP} most likely {alternatives}"
        )


def _first_difference(a: list[int] | list[float], b: list[int] | list[float]) -> int | None:
    """The first index where `a` and `b` differ (a length counts), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
