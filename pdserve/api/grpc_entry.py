"""The client gRPC entry, `DecodeService`: `Generate` streams a request's tokens through the
same `Run` as the HTTP API (one deadline at the edge, the same mailbox, idle abort and
metrics), and `GetStats` answers the node's snapshot.

Lifecycle of a Generate call: every value checked (a bad one fails this call alone) -> the
prompt tokenized off the event loop -> `Run.start` submits it -> outputs streamed as the engine
produces them -> a client gone mid-stream aborts the request end to end. A failed request ends
with the gRPC status its failure's reason maps to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from pdserve.api.metrics import ServingMetrics
from pdserve.api.node import ServingNode
from pdserve.api.protocol import APIError
from pdserve.api.run import Run, RunOptions
from pdserve.disagg.grpc_server import CallSlots, abort_with
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.disagg.wire import (
    generate_response,
    id_problem,
    sampling_from_proto,
    stats_to_proto,
    timeout_problem,
)
from pdserve.engine.failure import Failure, FailureReason
from pdserve.engine.sequence import SamplingError, SamplingParams
from pdserve.engine.structured import GuideError

logger = logging.getLogger(__name__)


def invalid(message: str) -> Failure:
    return Failure(FailureReason.INVALID_INPUT, message)


class DecodeServicer(pb_grpc.DecodeServiceServicer):
    def __init__(self, node: ServingNode, metrics: ServingMetrics, max_calls: int) -> None:
        self.node = node
        self.metrics = metrics
        self.slots = CallSlots(max_calls)  # generation calls at once

    async def GetStats(self, request: pb.StatsRequest, context: object) -> pb.NodeStats:
        return stats_to_proto(self.node.snapshot())

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        rid = request.request_id or f"req-{time.monotonic_ns()}"
        where = f"request {rid}"
        # aclosing: a client gone mid-stream runs _generate's abort now, not at collection.
        async with (
            self.slots.hold(context, where),
            contextlib.aclosing(self._generate(request, context, rid, where)) as out,
        ):
            async for response in out:
                yield response

    async def _checked(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, rid: str, where: str
    ) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the sampling parameters, every value checked."""
        node = self.node
        problem = (
            timeout_problem(request.timeout_s)
            or id_problem("request_id", rid)
            or id_problem("cache_salt", request.cache_salt)
        )
        if problem is not None:
            await abort_with(context, invalid(problem), where)
        try:
            params = sampling_from_proto(request.sampling)
        except SamplingError as e:
            await abort_with(context, invalid(str(e)), where)
        if params.guide is not None:  # compiled here: never on the engine thread
            try:
                await node.compile_guide(params.guide)
            except GuideError as e:
                await abort_with(context, invalid(str(e)), where)
        if not request.prompt:
            return list(request.token_ids), params
        limit = node.max_model_len
        if len(request.prompt) > limit * node.tokenizer.max_token_chars:
            message = f"a prompt of {len(request.prompt)} characters exceeds {limit} tokens"
            await abort_with(context, invalid(message), where)
        # Off the event loop and off the engine thread (which would stall every stream).
        return await asyncio.to_thread(node.tokenizer.encode, request.prompt), params

    async def _generate(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext,
        rid: str,
        where: str,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        prompt, params = await self._checked(request, context, rid, where)
        options = RunOptions(
            cache_salt=request.cache_salt or None,
            request_id=rid,
            timeout_s=request.timeout_s or None,
        )
        run = Run(self.node, self.metrics, prompt, params, options)
        try:
            await run.start()
        except APIError as e:
            await abort_with(context, e.failure, where)
        choice = run.choices[0]
        finished = False
        try:
            while not finished:
                out = await run.next(choice)
                finished = out.finished
                if out.failure is not None:
                    await abort_with(context, out.failure, where)
                yield generate_response(out, choice.sent_tokens)
                choice.sent_tokens = len(out.token_ids)
        finally:
            if not finished:
                logger.info("request %s: client went away; aborting", rid)
                await run.abort()
