"""The prefill node: gRPC `PrefillService` in front of an engine in prefill mode whose KV
sender pushes every layer to the decode node named in each request.

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
from concurrent.futures import Future

import grpc

from pdserve.disagg.engine_node import CallSlots, EngineNode, abort_with
from pdserve.disagg.kv_sender import Complete, KVSender, PrefillOutcome, SendTarget
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.disagg.transport import make_sender
from pdserve.disagg.transport.base import TransferSender
from pdserve.disagg.transport.regions import KVRegions
from pdserve.disagg.wire import (
    REFUSAL_METADATA,
    UNREGISTERED,
    deadline_problem,
    fingerprint,
    head_bounds_problem,
    id_problem,
    sampling_from_proto,
    stats_to_proto,
    top_logprobs_to_proto,
)
from pdserve.engine.block_pool import cache_keys, key_bytes, root_key
from pdserve.engine.failure import Failure, FailureReason, RequestFailed
from pdserve.engine.loop_post import post
from pdserve.engine.sequence import RequestOptions, SamplingError, SamplingParams
from pdserve.engine.structured import GuideError

logger = logging.getLogger(__name__)

MAX_REGISTERED_RECEIVERS = 1024


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(self, node: PrefillNode) -> None:
        self.node = node
        self.slots = CallSlots(node.config.max_concurrent_rpcs)  # generation calls at once

    async def GetPeerInfo(
        self, request: pb.PeerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.PeerInfo:
        address, node = request.decode_transfer_address, self.node
        await self._refuse_if_broken(context, "probe")
        # A decode on another backend is not registered: it refuses this node by the
        # fingerprint it gets back, which names both backends.
        if address and request.decode_transfer_backend == node.config.transfer_backend:
            problem = node.register_receiver(address, request.decode_transfer_metadata)
            if problem is not None:
                message = f"bad decode transfer address {address!r}: {problem}"
                await abort_with(context, Failure(FailureReason.INVALID_INPUT, message), "probe")
        shards = node.sender.sender.regions.shards
        return pb.PeerInfo(
            tp_size=len(shards),
            fingerprint=node.fingerprint,
            role="prefill",
            transfer_metadata=node.transfer_metadata,
            kv_ranks=[
                pb.KVRank(rank=r, head_start=s.head_start, head_count=s.num_heads)
                for r, s in enumerate(shards)
            ],
        )

    async def _refuse_if_broken(self, context: grpc.aio.ServicerContext, where: str) -> None:
        """A node that cannot compute (its tensor-parallel group broke) answers UNAVAILABLE:
        decode stops choosing it and sends the request to another prefill node."""
        healthy, why = self.node.health()
        if not healthy:
            await abort_with(context, Failure(FailureReason.PEER_UNAVAILABLE, why), where)

    async def GetStats(self, request: pb.StatsRequest, context: object) -> pb.NodeStats:
        return stats_to_proto(self.node.snapshot())

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        where = f"request {request.request_id} (unique key {request.unique_key})"
        async with self.slots.hold(context, where):
            return await self._prefill(request, context, where)

    async def _prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext, where: str
    ) -> pb.PrefillResponse:
        node = self.node
        key = request.unique_key
        await self._refuse_if_broken(context, where)
        problem = (
            deadline_problem(request.deadline_unix, time.time())
            or id_problem("request_id", request.request_id)
            or id_problem("unique_key", key)
            or id_problem("cache_salt", request.cache_salt)
        )
        if problem is not None:  # before anything is registered: this call fails alone
            await abort_with(context, Failure(FailureReason.INVALID_INPUT, problem), where)
        if time.time() >= request.deadline_unix:
            failure = Failure(FailureReason.DEADLINE, "deadline passed", "before prefill")
            await abort_with(context, failure, where)
        try:
            asked = sampling_from_proto(request.sampling)
            # Prefill samples only the first token (with min_tokens >= 1, never a stop token).
            params = dataclasses.replace(asked, max_tokens=1, min_tokens=min(asked.min_tokens, 1))
        except SamplingError as e:
            await abort_with(context, Failure(FailureReason.INVALID_INPUT, str(e)), where)
        if params.guide is not None:  # compiled off the engine thread (a cache hit there)
            try:
                await node.compile_guide(params.guide)
            except GuideError as e:
                await abort_with(context, Failure(FailureReason.INVALID_INPUT, str(e)), where)
        if not node.is_registered(request.decode_transfer_address):
            # Never pushed to a caller-chosen address: only where a decode registered its
            # receiver (GetPeerInfo). The trailer tells decode's client to register again.
            context.set_trailing_metadata(((REFUSAL_METADATA, UNREGISTERED),))
            message = (
                f"decode transfer address {request.decode_transfer_address!r} is not registered "
                "with this prefill node (GetPeerInfo registers it)"
            )
            await abort_with(context, Failure(FailureReason.INVALID_INPUT, message), where)
        tokens = list(request.token_ids)
        if len(request.target_block_ids) != -(-len(tokens) // node.block_size):
            message = f"{len(request.target_block_ids)} target blocks for {len(tokens)} tokens"
            await abort_with(context, Failure(FailureReason.INVALID_INPUT, message), where)
        logger.info(
            "%s: prefill %d tokens for %s", where, len(tokens), request.decode_transfer_address
        )
        regions = node.sender.sender.regions
        bounds = list(request.decode_kv_head_bounds) or [0, regions.num_kv_heads]
        problem = head_bounds_problem(bounds, regions.num_kv_heads)
        if problem is not None:
            await abort_with(context, Failure(FailureReason.INVALID_INPUT, problem), where)
        hash_key = node.engine_config.cache.hash_key
        root = root_key(request.cache_salt or None, hash_key)
        own_keys = cache_keys(tokens, node.block_size, root=root, key=hash_key)
        skip = 0
        for mine, theirs in zip(own_keys, request.cached_block_keys, strict=False):
            if key_bytes(mine) != theirs:
                break
            skip += 1
        target = SendTarget(
            request.request_id,
            key,
            request.decode_transfer_address,
            list(request.target_block_ids),
            skip,
            request.deadline_unix,
            tuple(regions.frame_heads(bounds)),
        )
        loop = asyncio.get_running_loop()
        done: asyncio.Future[PrefillOutcome] = loop.create_future()

        def resolve(outcome: PrefillOutcome) -> None:
            if not done.done():
                done.set_result(outcome)

        def on_complete(outcome: PrefillOutcome) -> None:
            post(loop, resolve, outcome)

        try:
            options = RequestOptions(cache_salt=request.cache_salt or None)
            await asyncio.wrap_future(node.admit(target, tokens, params, on_complete, options))
        except RequestFailed as e:
            await abort_with(context, e.failure, where)
        try:
            outcome = await asyncio.wait_for(done, request.deadline_unix - time.time())
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
        return pb.PrefillResponse(
            has_first_token=outcome.has_first_token,
            first_token=outcome.first_token,
            first_logprob=outcome.first_logprob,
            first_top=top_logprobs_to_proto(outcome.first_top),
            num_skipped_blocks=outcome.num_skipped_blocks,
            num_prefill_cached_tokens=outcome.num_prefill_cached_tokens,
            bytes_sent=outcome.bytes_sent,
            prefill_started_unix=outcome.started_at,
            last_layer_sent_unix=outcome.last_layer_sent_at,
            prefill_scheduled_unix=outcome.scheduled_at,
            prefill_computed_unix=outcome.computed_at,
        )


class PrefillNode(EngineNode):
    role = "prefill"
    accepts_requests = False  # decode calls it; clients do not
    # Set by `start`.
    _sender: TransferSender | None = None
    _kv_sender: KVSender | None = None
    fingerprint: pb.ModelFingerprint | None = None
    _receivers: collections.OrderedDict[str, None]  # registered decode KV receivers, LRU

    @property
    def block_size(self) -> int:
        return self.engine_config.cache.block_size

    @property
    def sender(self) -> KVSender:
        assert self._kv_sender is not None, "node not started"
        return self._kv_sender

    async def start(self) -> None:
        self._receivers = collections.OrderedDict()
        engine = await self._start_engine("prefill-engine")
        self._sender = make_sender(
            self.config.transfer_backend,
            KVRegions.sharded(engine.kv_shards),
            self.config.testing_transfer_delay_s,
            self.config.cluster_secret,
        )
        self._kv_sender = KVSender(
            self._sender,
            engine.model_config.num_layers,
            engine.block_size,
            wake=self.engine_thread.wake,
        )
        engine.attach_connector(self._kv_sender)
        self.fingerprint = fingerprint(
            engine.model_config,
            self.engine_config.dtype,
            self.block_size,
            self.engine_config.quantization,
            self.config.transfer_backend,
        )
        self.grpc = self._grpc_server()
        add = pb_grpc.add_PrefillServiceServicer_to_server  # generated: unannotated
        add(PrefillServicer(self), self.grpc.server)  # type: ignore[no-untyped-call]  # generated gRPC code
        self.engine_thread.start()
        await self.grpc.start()
        logger.info("prefill node serving on %s", self.grpc.address)

    def admit(
        self,
        target: SendTarget,
        tokens: list[int],
        params: SamplingParams,
        on_complete: Complete,
        options: RequestOptions | None = None,
    ) -> Future[None]:
        """Register the send target and add the request, on the engine thread."""
        sender, engine = self.sender, self._started_engine

        def admit() -> None:
            sender.add_target(target, on_complete)
            try:
                engine.add_request(target.unique_key, tokens, params, options)
            except Exception:
                sender.remove_target(target.unique_key)
                raise

        return self.engine_thread.call(admit)

    @property
    def transfer_metadata(self) -> bytes:
        assert self._sender is not None, "node not started"
        return self._sender.metadata()

    def register_receiver(self, address: str, metadata: bytes = b"") -> str | None:
        """Allow KV transfers to `address` (a decode's receiver, from its probe, with its
        transport metadata); why not, or None. The list is bounded: the least recently
        registered address goes first."""
        assert self._sender is not None, "node not started"
        problem = self._sender.register_peer(address, metadata)
        if problem is None:
            self._receivers[address] = None
            self._receivers.move_to_end(address)
            while len(self._receivers) > MAX_REGISTERED_RECEIVERS:
                self._receivers.popitem(last=False)
        return problem

    def is_registered(self, address: str) -> bool:
        return address in self._receivers

    def cancel(self, unique_key: str, failure: Failure) -> None:
        """Stop sending and abort the request (any thread)."""
        self.sender.cancel(unique_key, failure)
        self.engine_thread.abort(unique_key)

    async def stop(self) -> None:
        """Safe whatever started: each part is stopped only if it exists. The engine stops
        first, so calls in flight end with "the node is shutting down", not a bare cancel."""
        await super().stop()
        if self._sender is not None:
            self._sender.close()
