"""One HTTP request in flight: its engine requests (one per choice, `n`), the bounded mailboxes
their outputs arrive in, and the latency it records.

Lifecycle: `start` submits every choice to the node (a refused choice aborts the ones already
submitted and raises the refusal as an APIError) -> `next(choice)` hands out outputs as they
come, observing TTFT, inter-token gaps and end-to-end latency -> `abort` stops every choice
that has not finished (a client that went away).
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from pdserve.api.metrics import ServingMetrics
from pdserve.api.node import ServingNode
from pdserve.api.protocol import APIError
from pdserve.api.timing import STAGES, ttft_breakdown
from pdserve.engine.failure import RequestFailed
from pdserve.engine.loop_post import post
from pdserve.engine.output_mailbox import OutputMailbox, reader_gone
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import Milestone, RequestOptions, SamplingError, SamplingParams


@dataclass
class Choice:
    index: int
    request_id: str
    mailbox: OutputMailbox
    final: RequestOutput | None = None
    sent_tokens: int = 0


@dataclass(frozen=True)
class RunOptions:
    """How a request is run: `n` choices; the prefill node a router chose
    (RequestOptions.prefill_peer); the salt its cached blocks are shared under; the id the
    client gave it (the engine request's id when `n` is 1); its own timeout (None: the node's
    `--request-timeout`)."""

    n: int = 1
    prefill_peer: str | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    timeout_s: float | None = None


class Run:
    def __init__(
        self,
        node: ServingNode,
        metrics: ServingMetrics,
        prompt_ids: list[int],
        params: SamplingParams,
        options: RunOptions,
    ) -> None:
        self.node = node
        self.metrics = metrics
        self.prompt_ids = prompt_ids
        self.params = params
        self.options = options
        self.n = options.n
        self.created = int(time.time())
        self.id = options.request_id or uuid.uuid4().hex[:24]
        self.start_at = time.monotonic()
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.choices: list[Choice] = []
        self.timing: dict[str, float] | None = None  # TTFT breakdown of the first choice
        self.cached_tokens = 0  # the first choice's prefix-cache hit

    def _choice_id(self, index: int) -> str:
        if self.options.request_id is not None and self.n == 1:
            return self.options.request_id
        return f"{self.id}-{index}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # n > 1: choice 0's prompt is prefilled (remotely where the node splits); the other
        # choices wait for its KV and share its blocks, computing only the last partial block.
        # Every request gets its deadline here, at the edge, whoever prefills it.
        deadline = time.time() + (self.options.timeout_s or self.node.request_timeout_s)
        salt = self.options.cache_salt
        first = RequestOptions(deadline, prefill_peer=self.options.prefill_peer, cache_salt=salt)
        for i in range(self.n):
            after = self._choice_id(0)
            options = (
                first
                if i == 0
                else RequestOptions(deadline, allow_split=False, after=after, cache_salt=salt)
            )
            params = self.params
            if self.n > 1 and params.seed is not None:
                params = replace(params, seed=params.seed + i)
            request_id = self._choice_id(i)
            idle = functools.partial(self.node.abort, request_id, reader_gone(request_id))
            mailbox = OutputMailbox(self.node.reader_idle_timeout_s, idle)
            choice = Choice(i, request_id, mailbox)

            def deliver(out: RequestOutput, box: OutputMailbox = mailbox) -> None:
                post(loop, box.put, out)

            submitted = self.node.submit(
                choice.request_id, self.prompt_ids, params, deliver, options
            )
            try:
                await asyncio.wrap_future(submitted)
            except RequestFailed as e:
                await self.abort()
                raise APIError.of(e.failure) from e
            except SamplingError as e:
                await self.abort()
                raise APIError(str(e)) from e
            except BaseException:  # cancelled while the submit lands: abort it behind the add
                self.node.abort(choice.request_id)
                await self.abort()
                raise
            self.choices.append(choice)

    async def next(self, choice: Choice) -> RequestOutput:
        out = await choice.mailbox.get()
        now = time.monotonic()
        if choice.index == 0:
            self.cached_tokens = out.num_cached_tokens
        metrics = self.metrics
        if len(out.token_ids) > choice.sent_tokens:
            if self.first_at is None:
                self.first_at = now
                metrics.ttft.observe(now - self.start_at)
                if out.timings and Milestone.ARRIVED in out.timings:
                    self.timing = ttft_breakdown(out.timings, time.time())
                    for stage in STAGES:
                        metrics.ttft_stage.labels(stage).observe(max(0.0, self.timing[stage]))
            elif self.last_at is not None:
                metrics.itl.observe(now - self.last_at)
            self.last_at = now
        if out.finished:
            choice.final = out
            metrics.finished(out.finish_reason or "unknown")
            metrics.generation_tokens.inc(len(out.token_ids))
            if choice.index == 0:
                metrics.prompt_tokens.inc(len(self.prompt_ids))
            if all(c.final is not None for c in self.choices):
                metrics.e2e.observe(now - self.start_at)
        return out

    async def drain(self, choice: Choice) -> RequestOutput:
        """The choice's final output; raises its failure as an APIError."""
        try:
            while True:
                out = await self.next(choice)
                if out.finished:
                    if out.failure is not None:
                        raise APIError.of(out.failure)
                    return out
        except BaseException:
            await self.abort()
            raise

    async def abort(self) -> None:
        for c in self.choices:
            if c.final is None:
                self.node.abort(c.request_id)

    def usage(self) -> dict[str, Any]:
        """Tokens so far (all of them once every choice finished); `cached_tokens`: the prompt
        tokens the first choice found in the prefix cache instead of computing."""
        completion = sum(
            len(c.final.token_ids) if c.final is not None else c.sent_tokens for c in self.choices
        )
        prompt = len(self.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
