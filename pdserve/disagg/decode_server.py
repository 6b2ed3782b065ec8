"""The decode node, the entrance: gRPC `DecodeService.Generate` (streaming tokens) in front of
an engine in decode mode, the KV receiver that prefill nodes push into, and the prefill client.

Lifecycle of a Generate call: submit to the engine thread (tokenize, allocate, split or not)
-> stream outputs as the engine produces them -> on client cancel, abort end to end (the
prefill call is cancelled, the receive entry tombstoned, the blocks freed). A failed request
ends with the status its failure's reason maps to. Stopping the node fails every request in
flight with "the node is shutting down".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from pdserve.disagg.engine_node import CallSlots, EngineNode, abort_with
from pdserve.disagg.kv_loader import KVLayout, KVLoader, SplitPolicy
from pdserve.disagg.kv_receiver import KVReceiver
from pdserve.disagg.prefill_client import PrefillClient, ProbePolicy, Registration
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.disagg.resource_store import ResourceStore
from pdserve.disagg.transport import make_receiver
from pdserve.disagg.transport.base import TransferReceiver
from pdserve.disagg.transport.regions import KVRegions
from pdserve.disagg.wire import (
    fingerprint,
    id_problem,
    sampling_from_proto,
    stats_to_proto,
    timeout_problem,
)
from pdserve.engine.failure import Failure, FailureReason, RequestFailed
from pdserve.engine.loop_post import post
from pdserve.engine.output_mailbox import OutputMailbox, reader_gone
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import RequestOptions, SamplingError
from pdserve.engine.snapshot import NodeSnapshot
from pdserve.engine.structured import GuideError

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0


class DecodeServicer(pb_grpc.DecodeServiceServicer):
    def __init__(self, node: DecodeNode) -> None:
        self.node = node
        self.slots = CallSlots(node.config.max_concurrent_rpcs)  # generation calls at once

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

    async def _generate(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext,
        rid: str,
        where: str,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        node = self.node
        # Every value checked before anything is registered: a bad one fails this call alone.
        problem = (
            timeout_problem(request.timeout_s)
            or id_problem("request_id", rid)
            or id_problem("cache_salt", request.cache_salt)
        )
        if problem is not None:
            await abort_with(context, Failure(FailureReason.INVALID_INPUT, problem), where)
        try:
            params = sampling_from_proto(request.sampling)
        except SamplingError as e:
            await abort_with(context, Failure(FailureReason.INVALID_INPUT, str(e)), where)
        if params.guide is not None:  # compiled here: never on the engine thread
            try:
                await node.compile_guide(params.guide)
            except GuideError as e:
                await abort_with(context, Failure(FailureReason.INVALID_INPUT, str(e)), where)
        prompt: str | list[int] = list(request.token_ids)
        if request.prompt:
            limit = node.max_model_len
            if len(request.prompt) > limit * node.tokenizer.max_token_chars:
                message = f"a prompt of {len(request.prompt)} characters exceeds {limit} tokens"
                await abort_with(context, Failure(FailureReason.INVALID_INPUT, message), where)
            # Off the event loop and off the engine thread (which would stall every stream).
            prompt = await asyncio.to_thread(node.tokenizer.encode, request.prompt)
        timeout = request.timeout_s or node.config.request_timeout_s
        loop = asyncio.get_running_loop()
        idle = functools.partial(node.abort, rid, reader_gone(rid))
        outputs = OutputMailbox(node.config.reader_idle_timeout_s, idle)
        salt = request.cache_salt or None
        options = RequestOptions(deadline=time.time() + timeout, cache_salt=salt)

        def on_output(out: RequestOutput) -> None:
            post(loop, outputs.put, out)

        try:
            await asyncio.wrap_future(node.submit(rid, prompt, params, on_output, options))
        except RequestFailed as e:
            await abort_with(context, e.failure, where)
        finished = False
        sent = 0  # tokens streamed so far (an output may bring several: see OutputMailbox)
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                if out.failure is not None:
                    await abort_with(context, out.failure, where)
                yield pb.GenerateResponse(
                    token_ids=out.token_ids[sent:],
                    text=out.delta_text,
                    finished=out.finished,
                    finish_reason=out.finish_reason or "",
                    logprobs=out.logprobs[sent:],
                    remote_prefill=sent == 0 and out.remote_prefill,
                    num_cached_tokens=out.num_cached_tokens,
                )
                sent = len(out.token_ids)
        finally:
            if not finished:
                logger.info("request %s: client went away; aborting", rid)
                node.abort(rid)


class DecodeNode(EngineNode):
    role = "decode"
    # Set by `start`.
    receiver: TransferReceiver | None = None
    client: PrefillClient | None = None
    transfer_address = ""
    _probe_task: asyncio.Task[None] | None = None

    def knows_prefill(self, address: str) -> bool:
        return address in self.config.prefill_addresses

    async def start(self) -> None:
        engine = await self._start_engine("decode-engine")
        store = ResourceStore(on_ready=lambda key: self.engine_thread.wake())
        regions = KVRegions.sharded(engine.kv_shards)
        kv_receiver = KVReceiver(store, regions, on_frame=self.observer.on_frame)
        cfg = self.config
        self.receiver = make_receiver(cfg, kv_receiver, regions, store.expecting)
        self.transfer_address = self.receiver.advertised(cfg.advertise_host)
        node_fingerprint = fingerprint(
            engine.model_config,
            self.engine_config.dtype,
            engine.block_size,
            self.engine_config.quantization,
            self.config.transfer_backend,
        )
        registration = Registration(
            self.transfer_address,
            cfg.transfer_backend,
            self.receiver.metadata(),
            self.receiver.add_peer,
        )
        self.client = PrefillClient(
            list(cfg.prefill_addresses),
            node_fingerprint,
            registration,
            ProbePolicy(cap_s=cfg.probe_cap_s),
            (cfg.cluster_secret, cfg.tls),
        )
        layout = KVLayout(
            engine.model_config.num_layers,
            engine.block_size,
            regions.block_bytes,
            tuple(regions.bounds),
        )
        engine.attach_connector(
            KVLoader(
                store,
                self.client,
                asyncio.get_running_loop(),
                layout,
                SplitPolicy(cfg.min_prompt_tokens, cfg.request_timeout_s),
                on_handoff=self.observer.on_handoff,
            )
        )
        self.grpc = self._grpc_server()
        add = pb_grpc.add_DecodeServiceServicer_to_server  # generated: unannotated
        add(DecodeServicer(self), self.grpc.server)  # type: ignore[no-untyped-call]  # generated gRPC code
        self.engine_thread.start()
        await self.grpc.start()
        self._probe_task = asyncio.create_task(self._probe_loop())
        logger.info(
            "decode node serving on %s (KV receiver %s, prefill %s)",
            self.grpc.address,
            self.transfer_address,
            ", ".join(cfg.prefill_addresses),
        )

    async def _probe_loop(self) -> None:
        assert self.client is not None
        while True:
            await self.client.probe_all()
            await asyncio.sleep(PROBE_INTERVAL_S)

    def health(self) -> tuple[bool, str]:
        if self.client is None or self._thread is None:
            return False, "starting"
        if not self.client.has_verified():
            return False, "no prefill node reachable"
        return True, "ok"

    def endpoints(self) -> list[str]:
        return [*super().endpoints(), f"transfer={self.transfer_address}"]

    def snapshot(self) -> NodeSnapshot:
        snap = super().snapshot()
        if self.receiver is not None:
            snap.transfer_connections = dict(self.receiver.stats())
        return snap

    async def stop(self) -> None:
        """Safe whatever started: each part is stopped only if it exists."""
        if self._probe_task is not None:
            self._probe_task.cancel()
        await super().stop()  # the engine first: calls in flight get a clear error
        if self.receiver is not None:
            self.receiver.stop()
        if self.client is not None:
            await self.client.close()
