"""Prefill's gRPC `PrefillService`: the probe a decode registers its KV receiver with, and the
Prefill call that computes a prompt on this node and pushes its KV, layer by layer, into the
decode blocks the call names. The node it serves (`PrefillHost`) is assembled in `serve`.

Lifecycle of a Prefill call: validate -> on the engine thread, register the send target and add
the request (max_tokens 1) -> the engine computes the prompt, the sender pushes its layers ->
the first token and the send outcome come back together -> the response, or the status the
failure's reason maps to. If the caller cancels or the shared deadline passes, the request is
aborted (queued writes dropped, blocks freed once the write in flight is out).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import grpc

from pdserve import tracing
from pdserve.disagg.grpc_server import CallSlots, abort_with
from pdserve.disagg.kv_sender import KVSender
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.disagg.send_target import Complete, PrefillOutcome, SendTarget
from pdserve.disagg.wire import (
    REFUSAL_METADATA,
    UNREGISTERED,
    deadline_problem,
    head_bounds_problem,
    id_problem,
    peer_info,
    prefill_response,
    sampling_from_proto,
    stats_to_proto,
)
from pdserve.engine.block_pool import cache_keys, key_bytes, root_key
from pdserve.engine.failure import Failure, FailureReason, RequestFailed
from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.loop_post import post
from pdserve.engine.sequence import Guide, RequestOptions, SamplingError, SamplingParams
from pdserve.engine.snapshot import NodeSnapshot
from pdserve.engine.structured import GuideError

logger = logging.getLogger(__name__)

MAX_REGISTERED_RECEIVERS = 1024


class PrefillHost(Protocol):
    """What the service needs from its prefill node."""

    fingerprint: pb.ModelFingerprint

    @property
    def transfer_backend(self) -> str: ...

    @property
    def block_size(self) -> int: ...

    @property
    def hash_key(self) -> bytes:
        """The cluster's key for prefix-cache block keys (empty: unkeyed)."""
        ...

    @property
    def sender(self) -> KVSender: ...

    def health(self) -> tuple[bool, str]: ...

    def snapshot(self) -> NodeSnapshot: ...

    def kv_events(self) -> KVEventLog:
        """What its prefix cache holds, as changes a router follows."""
        ...

    async def compile_guide(self, guide: Guide) -> None: ...

    def admit(
        self,
        target: SendTarget,
        tokens: list[int],
        params: SamplingParams,
        on_complete: Complete,
        options: RequestOptions,
    ) -> Future[None]:
        """Register the send target and add the request, on the engine thread."""
        ...

    def migrate(
        self, target: SendTarget, tokens: list[int], handle: str, on_complete: Complete
    ) -> Future[None]:
        """Send the KV of `tokens` of the stream paused here as `handle` (a decode node's live
        migration; RequestFailed where it holds none such)."""
        ...

    def cancel(self, unique_key: str, failure: Failure) -> None:
        """Stop sending and abort the request (any thread)."""
        ...


def refusal(message: str) -> Future[None]:
    """What a host answers a call it does not serve (`admit` on a decode node, `migrate` on a
    prefill node): the call fails with INVALID_INPUT, saying why."""
    refused: Future[None] = Future()
    refused.set_exception(RequestFailed(Failure(FailureReason.INVALID_INPUT, message)))
    return refused


class Receivers:
    """The decode KV receivers this node may push to: only addresses a decode registered with
    its probe, never one a Prefill call names. Bounded: the least recently registered goes."""

    def __init__(self, sender: KVSender) -> None:
        self.transport = sender.sender
        self._addresses: collections.OrderedDict[str, None] = collections.OrderedDict()

    def register(self, address: str, metadata: bytes) -> str | None:
        """Allow transfers to `address` (with its transport metadata); why not, or None."""
        problem = self.transport.register_peer(address, metadata)
        if problem is None:
            self._addresses[address] = None
            self._addresses.move_to_end(address)
            while len(self._addresses) > MAX_REGISTERED_RECEIVERS:
                self._addresses.popitem(last=False)
        return problem

    def __contains__(self, address: str) -> bool:
        return address in self._addresses


def trace_outcome(span: tracing.Span, target: SendTarget, outcome: PrefillOutcome) -> None:
    """A prefill's stages on its span: the queue, the compute and the KV transfer (which runs
    beside the compute, layer by layer; its exposed part is what came after the last layer)."""
    if span.traceparent is None:
        return
    o = outcome
    cached = o.num_prefill_cached_tokens
    span.record("pdserve.prefill.queue", o.started_at, o.scheduled_at or o.started_at)
    if o.scheduled_at and o.computed_at:
        compute = {"pdserve.prompt_tokens": target.num_tokens, "pdserve.cached_tokens": cached}
        span.record("pdserve.prefill.compute", o.scheduled_at, o.computed_at, compute)
    if o.scheduled_at and o.last_layer_sent_at:
        seconds = max(o.last_layer_sent_at - o.scheduled_at, 1e-9)
        transfer: tracing.Attributes = {
            "pdserve.kv.bytes": o.bytes_sent,
            "pdserve.kv.blocks": len(target.dst_blocks) - o.num_skipped_blocks,
            "pdserve.kv.skipped_blocks": o.num_skipped_blocks,
            "pdserve.kv.links": len(target.heads),
            "pdserve.kv.destination": target.peer,
            "pdserve.kv.gb_per_s": o.bytes_sent / seconds / 1e9,
            "pdserve.kv.exposed_s": max(0.0, o.last_layer_sent_at - (o.computed_at or 0.0)),
        }
        span.record("pdserve.kv.transfer", o.scheduled_at, o.last_layer_sent_at, transfer)


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(self, node: PrefillHost, max_calls: int) -> None:
        self.node = node
        self.slots = CallSlots(max_calls)  # generation calls at once
        self.receivers = Receivers(node.sender)

    async def GetPeerInfo(
        self, request: pb.PeerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.PeerInfo:
        address, node = request.decode_transfer_address, self.node
        await self._refuse_if_broken(context, "probe")
        # A decode on another backend is not registered: it refuses this node by the
        # fingerprint it gets back, which names both backends.
        if address and request.decode_transfer_backend == node.transfer_backend:
            problem = self.receivers.register(address, request.decode_transfer_metadata)
            if problem is not None:
                message = f"bad decode transfer address {address!r}: {problem}"
                await abort_with(context, Failure(FailureReason.INVALID_INPUT, message), "probe")
        transport = node.sender.sender
        return peer_info(node.fingerprint, transport.metadata(), transport.regions.shards)

    async def _refuse_if_broken(self, context: grpc.aio.ServicerContext, where: str) -> None:
        """A node that cannot compute (its tensor-parallel group broke) answers UNAVAILABLE:
        decode stops choosing it and sends the request to another prefill node."""
        healthy, why = self.node.health()
        if not healthy:
            await abort_with(context, Failure(FailureReason.PEER_UNAVAILABLE, why), where)

    async def GetStats(self, request: pb.StatsRequest, context: object) -> pb.NodeStats:
        return stats_to_proto(self.node.snapshot())

    async def GetKVEvents(self, request: pb.KVEventsRequest, context: object) -> pb.KVEvents:
        """The prefix cache's changes after `since` (a router's prefix index of prefill nodes
        follows them; behind the cluster secret, like every call)."""
        c = self.node.kv_events().since(request.since, request.epoch or None)
        return pb.KVEvents(
            epoch=c.epoch,
            seq=c.seq,
            reset=c.reset,
            stored=[key_bytes(k) for k in c.stored],
            removed=[key_bytes(k) for k in c.removed],
        )

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        where = f"request {request.request_id} (unique key {request.unique_key})"
        parent = dict(context.invocation_metadata() or ()).get(tracing.TRACEPARENT)
        span = tracing.start(
            "pdserve.prefill.request",
            parent if isinstance(parent, str) else None,
            tracing.Kind.SERVER,
            {
                "pdserve.unique_key": request.unique_key,
                "pdserve.migrate": bool(request.migrate_handle),
            },
        )
        try:
            return await self._prefill(request, context, where, span)
        except BaseException as e:
            if span.traceparent is not None:  # (abort_with logged the failure's reason)
                code = context.code() if hasattr(context, "code") else None
                span.fail(getattr(code, "name", type(e).__name__).lower(), str(e) or repr(e))
            raise
        finally:
            span.end()

    async def _prefill(
        self,
        request: pb.PrefillRequest,
        context: grpc.aio.ServicerContext,
        where: str,
        span: tracing.Span,
    ) -> pb.PrefillResponse:
        async with self.slots.hold(context, where):
            await self._refuse_if_broken(context, where)
            if request.migrate_handle:  # a decode's stream: its KV is sent, nothing computed
                await self._check_call(request, context, where)
                target = await self._target(request, context, where)
                tokens, handle = list(request.token_ids), request.migrate_handle
                logger.info("%s: sending the KV of stream %s", where, handle)
                outcome = await self._run(
                    target,
                    lambda done: self.node.migrate(target, tokens, handle, done),
                    context,
                    where,
                )
                trace_outcome(span, target, outcome)
                return prefill_response(outcome)
            params = await self._checked(request, context, where)
            target = await self._target(request, context, where)
            options = RequestOptions(cache_salt=request.cache_salt or None)
            tokens = list(request.token_ids)
            outcome = await self._run(
                target,
                lambda done: self.node.admit(target, tokens, params, done, options),
                context,
                where,
            )
            trace_outcome(span, target, outcome)
            return prefill_response(outcome)

    async def _check_call(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext, where: str
    ) -> None:
        """The call's deadline and ids, checked before anything is registered."""
        problem = (
            deadline_problem(request.deadline_unix, time.time())
            or id_problem("request_id", request.request_id)
            or id_problem("unique_key", request.unique_key)
            or id_problem("cache_salt", request.cache_salt)
            or (request.migrate_handle and id_problem("migrate_handle", request.migrate_handle))
        )
        if problem:
            await abort_with(context, Failure(FailureReason.INVALID_INPUT, problem), where)
        if time.time() >= request.deadline_unix:
            failure = Failure(FailureReason.DEADLINE, "deadline passed", "before prefill")
            await abort_with(context, failure, where)

    async def _checked(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext, where: str
    ) -> SamplingParams:
        """The call's sampling parameters, once every value is checked; nothing is registered
        before, so a bad value fails this call alone."""
        await self._check_call(request, context, where)
        try:
            asked = sampling_from_proto(request.sampling)
            # Prefill samples only the first token (with min_tokens >= 1, never a stop token).
            params = dataclasses.replace(asked, max_tokens=1, min_tokens=min(asked.min_tokens, 1))
        except SamplingError as e:
            await abort_with(context, Failure(FailureReason.INVALID_INPUT, str(e)), where)
        if params.guide is not None:  # compiled off the engine thread (a cache hit there)
            try:
                await self.node.compile_guide(params.guide)
            except GuideError as e:
                await abort_with(context, Failure(FailureReason.INVALID_INPUT, str(e)), where)
        return params

    async def _target(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext, where: str
    ) -> SendTarget:
        """Where the prompt's KV goes: a registered receiver's blocks, minus the prefix decode
        already holds under the same block keys as this node's."""
        node, address = self.node, request.decode_transfer_address
        if address not in self.receivers:
            # The trailer tells decode's client to register again (a probe) and retry.
            context.set_trailing_metadata(((REFUSAL_METADATA, UNREGISTERED),))
            message = (
                f"decode transfer address {address!r} is not registered "
                "with this prefill node (GetPeerInfo registers it)"
            )
            await abort_with(context, Failure(FailureReason.INVALID_INPUT, message), where)
        tokens = list(request.token_ids)
        if len(request.target_block_ids) != -(-len(tokens) // node.block_size):
            message = f"{len(request.target_block_ids)} target blocks for {len(tokens)} tokens"
            await abort_with(context, Failure(FailureReason.INVALID_INPUT, message), where)
        logger.info("%s: prefill %d tokens for %s", where, len(tokens), address)
        regions = node.sender.sender.regions
        bounds = list(request.decode_kv_head_bounds) or [0, regions.num_kv_heads]
        problem = head_bounds_problem(bounds, regions.num_kv_heads)
        if problem is not None:
            await abort_with(context, Failure(FailureReason.INVALID_INPUT, problem), where)
        root = root_key(request.cache_salt or None, node.hash_key)
        own_keys = cache_keys(tokens, node.block_size, root=root, key=node.hash_key)
        skip = 0
        for mine, theirs in zip(own_keys, request.cached_block_keys, strict=False):
            if key_bytes(mine) != theirs:
                break
            skip += 1
        return SendTarget(
            request.request_id,
            request.unique_key,
            address,
            list(request.target_block_ids),
            skip,
            request.deadline_unix,
            tuple(regions.frame_heads(bounds)),
            num_tokens=len(tokens),
        )

    async def _run(
        self,
        target: SendTarget,
        start: Callable[[Complete], Future[None]],
        context: grpc.aio.ServicerContext,
        where: str,
    ) -> PrefillOutcome:
        """Compute (or take) and send, as `start` begins it with the callback of its outcome;
        the outcome, or the call ended with its failure."""
        node, key = self.node, target.unique_key
        deadline = target.deadline
        loop = asyncio.get_running_loop()
        done: asyncio.Future[PrefillOutcome] = loop.create_future()

        def resolve(outcome: PrefillOutcome) -> None:
            if not done.done():
                done.set_result(outcome)

        def on_complete(outcome: PrefillOutcome) -> None:
            post(loop, resolve, outcome)

        try:
            await asyncio.wrap_future(start(on_complete))
        except RequestFailed as e:
            await abort_with(context, e.failure, where)
        try:
            outcome = await asyncio.wait_for(done, deadline - time.time())
        except TimeoutError:
            failure = Failure(FailureReason.DEADLINE, "deadline passed", "prefill/transfer")
            logger.warning("%s: deadline passed (%s)", where, node.sender.progress(key))
            node.cancel(key, failure)
            await abort_with(context, failure, where)
        except asyncio.CancelledError:
            logger.info("%s cancelled by decode; aborting", where)
            node.cancel(key, Failure(FailureReason.CANCELLED, "cancelled by decode", "prefill"))
            raise
        if outcome.failure is not None:
            await abort_with(context, outcome.failure, where)
        return outcome
