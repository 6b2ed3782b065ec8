"""The decode node, the entrance: gRPC `DecodeService.Generate` (streaming tokens) in front of
an engine in decode mode, the KV receiver that prefill nodes push into, and the prefill client.

Lifecycle of a Generate call: submit to the engine thread (tokenize, allocate, split or not)
-> stream outputs as the engine produces them -> on client cancel, abort end to end (the
prefill call is cancelled, the receive entry tombstoned, the blocks freed). Stopping the node
fails every request in flight with "the node is shutting down".
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import grpc

from pdserve.config import EngineConfig
from pdserve.disagg.kv_loader import KVLoader, SplitPolicy, sampling_from_proto
from pdserve.disagg.kv_receiver import KVReceiver
from pdserve.disagg.node_common import (
    EngineNode,
    GrpcServer,
    NodeConfig,
    fingerprint,
)
from pdserve.disagg.prefill_client import PrefillClient
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.disagg.resource_store import ResourceStore
from pdserve.disagg.transport import inprocess
from pdserve.disagg.transport.base import KVRegions
from pdserve.disagg.transport.tcp import TcpReceiverServer
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.llm_engine import LLMEngine, RequestError, RequestOutput
from pdserve.engine.sequence import SamplingError

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0


class DecodeServicer(pb_grpc.DecodeServiceServicer):
    def __init__(self, node: DecodeNode) -> None:
        self.node = node

    async def GetStats(self, request: pb.StatsRequest, context: object) -> pb.NodeStats:
        return await self.node.stats()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        node = self.node
        rid = request.request_id or f"req-{time.monotonic_ns()}"
        try:
            params = sampling_from_proto(request.sampling)
        except SamplingError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: {e}")
        prompt: str | list[int] = request.prompt or list(request.token_ids)
        timeout = request.timeout_s or node.config.request_timeout_s
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        extras = {"deadline": time.time() + timeout}

        def on_output(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        submitted = node.engine_thread.submit(rid, prompt, params, on_output, extras)
        try:
            await asyncio.wrap_future(submitted)
        except (RequestError, SamplingError, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finished = False
        first = True
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                if out.error is not None:
                    code = grpc.StatusCode.UNAVAILABLE
                    if "deadline" in out.error or "timed out" in out.error:
                        code = grpc.StatusCode.DEADLINE_EXCEEDED
                    await context.abort(code, f"request {rid}: {out.error}")
                yield pb.GenerateResponse(
                    token_ids=out.token_ids[-1:] if out.token_ids else [],
                    text=out.delta_text,
                    finished=out.finished,
                    finish_reason=out.finish_reason or "",
                    logprobs=out.logprobs[-1:] if out.logprobs else [],
                    remote_prefill=first and bool(out.remote_prefill),
                    num_cached_tokens=out.num_cached_tokens,
                )
                first = False
        finally:
            if not finished:
                logger.info("request %s: client went away; aborting", rid)
                node.engine_thread.abort(rid)


class DecodeNode(EngineNode):
    def __init__(self, engine_config: EngineConfig, model_dir: Path, config: NodeConfig) -> None:
        super().__init__(engine_config, model_dir, config)
        self.receiver_server: TcpReceiverServer | None = None
        self.client: PrefillClient | None = None
        self.loader: KVLoader | None = None
        self.receiver: KVReceiver | None = None
        self.store = ResourceStore()
        self.transfer_address = ""
        self._probe_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        engine = await asyncio.to_thread(LLMEngine, self.engine_config, self.model_dir)
        self.engine_thread_ = EngineThread(engine, "decode-engine")
        self.store = ResourceStore(on_ready=lambda key: self.engine_thread.wake())
        receiver = self.receiver = KVReceiver(self.store, KVRegions(engine.kv_caches))
        abort_writers = None
        if self.config.transfer_backend == "inprocess":
            self.transfer_address = f"inprocess-{id(self)}"
            inprocess.register_receiver(self.transfer_address, receiver.receive)
        else:
            self.receiver_server = TcpReceiverServer(
                receiver.receive, self.config.host, self.config.transfer_port
            )
            port = self.receiver_server.address.rpartition(":")[2]
            self.transfer_address = f"{self.config.advertise_host or self.config.host}:{port}"
            abort_writers = self.receiver_server.abort_key
        self.fingerprint = fingerprint(engine)
        self.client = PrefillClient(
            list(self.config.prefill_addresses),
            self.fingerprint,
            probe_cap_s=self.config.probe_cap_s,
        )
        self.loader = KVLoader(
            self.store,
            self.client,
            asyncio.get_running_loop(),
            self.transfer_address,
            engine.model_config.num_layers,
            engine.block_size,
            receiver.regions.block_bytes,
            SplitPolicy(self.config.min_prompt_tokens, self.config.request_timeout_s),
            abort_writers or (lambda key: None),
        )
        engine.connector = self.loader
        self.grpc = GrpcServer(self.config.host, self.config.port)
        pb_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(self), self.grpc.server)
        self.engine_thread.start()
        await self.grpc.start()
        self._probe_task = asyncio.create_task(self._probe_loop())
        logger.info(
            "decode node serving on %s (KV receiver %s, prefill %s)",
            self.grpc.address,
            self.transfer_address,
            ", ".join(self.config.prefill_addresses),
        )

    async def _probe_loop(self) -> None:
        assert self.client is not None
        while True:
            await self.client.probe_all()
            await asyncio.sleep(PROBE_INTERVAL_S)

    async def stats(self) -> pb.NodeStats:
        """Counters read without the engine thread (a long step must not delay them)."""
        engine, store, loader = self.engine, self.store, self.loader
        assert loader is not None
        sizes = store.sizes()
        return pb.NodeStats(
            num_blocks=engine.num_blocks,
            num_free_blocks=engine.pool.num_free,
            num_requests=len(engine.requests),
            resource_store_entries=sizes["entries"],
            side_channel_entries=sizes["side_channel"],
            tombstones=sizes["tombstones"],
            pending_tasks=loader.num_pending,
            frames_rejected=sum(store.frames_rejected.values()),
            bytes_received=store.bytes_received,
            not_split=sum(loader.not_split.values()),
        )

    async def stop(self) -> None:
        """Safe whatever started: each part is stopped only if it exists."""
        if self._probe_task is not None:
            self._probe_task.cancel()
        if self.engine_thread_ is not None:  # first: calls in flight get a clear error
            await asyncio.to_thread(self.engine_thread_.stop)
        if self.grpc is not None:
            await self.grpc.stop()
        if self.receiver_server is not None:
            self.receiver_server.stop()
        if self.transfer_address.startswith("inprocess-"):
            inprocess.unregister_receiver(self.transfer_address)
        if self.client is not None:
            await self.client.close()
