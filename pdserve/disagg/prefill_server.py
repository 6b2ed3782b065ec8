"""The prefill node: gRPC `PrefillService` in front of an engine in prefill mode whose KV
sender pushes every layer to the decode node named in each request.

Lifecycle of a Prefill call: validate -> on the engine thread, register the send target and add
the request (max_tokens 1) -> the engine computes the prompt, the sender pushes its layers ->
the first token and the send outcome come back together -> the response. If the caller cancels
or the shared deadline passes, the request is aborted (queued writes dropped, blocks freed once
the write in flight is out).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

import grpc

from pdserve.config import EngineConfig
from pdserve.disagg.kv_loader import sampling_from_proto
from pdserve.disagg.kv_sender import KVSender, PrefillOutcome, SendTarget
from pdserve.disagg.node_common import (
    EngineNode,
    GrpcServer,
    NodeConfig,
    fingerprint,
)
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.disagg.transport import make_sender
from pdserve.disagg.transport.base import KVRegions, TransferSender
from pdserve.engine.block_pool import cache_keys
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingError

logger = logging.getLogger(__name__)


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(self, node: PrefillNode) -> None:
        self.node = node

    async def GetPeerInfo(self, request: pb.PeerInfoRequest, context: object) -> pb.PeerInfo:
        return pb.PeerInfo(tp_size=1, fingerprint=self.node.fingerprint, role="prefill")

    async def GetStats(self, request: pb.StatsRequest, context: object) -> pb.NodeStats:
        return await self.node.stats()

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        node = self.node
        key = request.unique_key
        where = f"request {request.request_id} (unique key {key})"
        if time.time() >= request.deadline_unix:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{where}: deadline passed")
        try:
            params = dataclasses.replace(sampling_from_proto(request.sampling), max_tokens=1)
        except SamplingError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {e}")
        tokens = list(request.token_ids)
        if len(request.target_block_ids) != node.engine.kv.blocks_for(len(tokens)):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: {len(request.target_block_ids)} target blocks for {len(tokens)} tokens",
            )
        logger.info(
            "%s: prefill %d tokens for %s", where, len(tokens), request.decode_transfer_address
        )
        own_keys = cache_keys(tokens, node.engine.block_size)
        skip = 0
        for mine, theirs in zip(own_keys, request.cached_block_keys, strict=False):
            if mine != theirs:
                break
            skip += 1
        target = SendTarget(
            request.request_id,
            key,
            request.decode_transfer_address,
            list(request.target_block_ids),
            skip,
            request.deadline_unix,
        )
        loop = asyncio.get_running_loop()
        done: asyncio.Future[PrefillOutcome] = loop.create_future()

        def resolve(outcome: PrefillOutcome) -> None:
            if not done.done():
                done.set_result(outcome)

        def on_complete(outcome: PrefillOutcome) -> None:
            loop.call_soon_threadsafe(resolve, outcome)

        def admit() -> None:
            node.sender.add_target(target, on_complete)
            try:
                node.engine.add_request(key, tokens, params)
            except Exception:
                node.sender.remove_target(key)
                raise

        try:
            await asyncio.wrap_future(node.engine_thread.call(admit))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {e}")
        try:
            outcome = await asyncio.wait_for(done, request.deadline_unix - time.time())
        except TimeoutError:
            node.sender.cancel(key, "deadline passed (stage: prefill/transfer)")
            node.engine_thread.abort(key)
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"{where}: deadline passed (stage: prefill)"
            )
        except asyncio.CancelledError:
            logger.info("%s cancelled by decode; aborting", where)
            node.sender.cancel(key, "cancelled by decode (aborted)")
            node.engine_thread.abort(key)
            raise
        if outcome.error is not None:
            await context.abort(grpc.StatusCode.ABORTED, f"{where}: {outcome.error}")
        return pb.PrefillResponse(
            has_first_token=outcome.has_first_token,
            first_token=outcome.first_token,
            first_logprob=outcome.first_logprob,
            num_skipped_blocks=outcome.num_skipped_blocks,
            num_prefill_cached_tokens=outcome.num_prefill_cached_tokens,
            bytes_sent=outcome.bytes_sent,
            prefill_started_unix=outcome.started_at,
            last_layer_sent_unix=outcome.last_layer_sent_at,
            prefill_scheduled_unix=outcome.scheduled_at,
            prefill_computed_unix=outcome.computed_at,
        )


class PrefillNode(EngineNode):
    def __init__(self, engine_config: EngineConfig, model_dir: Path, config: NodeConfig) -> None:
        super().__init__(engine_config, model_dir, config)
        self._sender: TransferSender | None = None
        self._kv_sender: KVSender | None = None
        self.transfer_address = ""  # the TCP backend pushes to decode; prefill listens on none

    @property
    def sender(self) -> KVSender:
        assert self._kv_sender is not None, "node not started"
        return self._kv_sender

    async def start(self) -> None:
        engine = await asyncio.to_thread(LLMEngine, self.engine_config, self.model_dir)
        self._sender = make_sender(
            self.config.transfer_backend,
            KVRegions(engine.kv_caches),
            self.config.testing_transfer_delay_s,
        )
        self._kv_sender = KVSender(self._sender, engine.model_config.num_layers, engine.block_size)
        engine.connector = self._kv_sender
        engine.scheduler.hold_blocks = self._kv_sender.request_finished
        self.engine_thread_ = EngineThread(engine, "prefill-engine")
        self._kv_sender.wake = self.engine_thread.wake
        self.fingerprint = fingerprint(engine)
        self.grpc = GrpcServer(self.config.host, self.config.port)
        pb_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(self), self.grpc.server)
        self.engine_thread.start()
        await self.grpc.start()
        logger.info("prefill node serving on %s", self.grpc.address)

    async def stats(self) -> pb.NodeStats:
        """Counters read without the engine thread (a long step must not delay them)."""
        engine, sender = self.engine, self.sender
        return pb.NodeStats(
            num_blocks=engine.num_blocks,
            num_free_blocks=engine.pool.num_free,
            num_requests=len(engine.requests),
            pending_tasks=sender.sizes()["sending"],
            held_for_send=len(engine.scheduler.held),
            bytes_sent=sender.sender.bytes_sent,
        )

    async def stop(self) -> None:
        """Safe whatever started: each part is stopped only if it exists. The engine stops
        first, so calls in flight end with "the node is shutting down", not a bare cancel."""
        if self.engine_thread_ is not None:
            await asyncio.to_thread(self.engine_thread_.stop)
        if self.grpc is not None:
            await self.grpc.stop()
        if self._sender is not None:
            self._sender.close()
