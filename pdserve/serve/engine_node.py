"""What every node needs: the engine built from configs on its own thread, a gRPC server that
can be stopped whatever started, and the narrow interface the HTTP API and the gRPC services
use (tokenizer, limits, submit/abort, snapshot, health) instead of reaching into the engine.

Lifecycle: construct (nothing runs) -> `start` (subclasses build the engine with
`_start_engine`, wire their connector, then start serving) -> `stop`, safe whatever started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import Future
from pathlib import Path

from pdserve.api.metrics import ServingMetrics
from pdserve.config import EngineConfig, ModelConfig, NodeConfig
from pdserve.disagg.grpc_server import GrpcServer
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.wire import NodeTerms, fingerprint
from pdserve.engine.block_pool import keyed_with
from pdserve.engine.engine_thread import ADMIT_WINDOW_S, EngineThread, OutputCallback
from pdserve.engine.failure import Failure
from pdserve.engine.guide_worker import GuideWorkers
from pdserve.engine.kv_cache import kv_layout, layer_block_bytes
from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import Guide, RequestOptions, SamplingParams
from pdserve.engine.snapshot import NodeSnapshot
from pdserve.model.linear import deterministic_kernels
from pdserve.model.loader import TORCH_DTYPES
from pdserve.model.tokenizer import Tokenizer, tokenizer_digest


class EngineNode:
    """A node around one engine thread. `accepts_requests`: whether clients send generation
    requests here (decode, colocated) or only peers call it (prefill)."""

    role = "engine"
    accepts_requests = True
    # Prompt tokens after which a step takes no new prompt, unless configured (None: no limit).
    prefill_step_tokens: int | None = None

    def __init__(
        self,
        engine_config: EngineConfig,
        model_dir: Path,
        config: NodeConfig,
        metrics: ServingMetrics | None = None,
    ) -> None:
        self.config = config
        cache = engine_config.cache
        if config.cluster_secret is not None:  # cache keys keyed with the cluster's secret
            cache = dataclasses.replace(cache, hash_key=keyed_with(config.cluster_secret.value))
        if config.transfer_backend == "nixl":  # its agent registers the cache: memory stays
            cache = dataclasses.replace(cache, window_memory=False)
        if cache is not engine_config.cache:
            engine_config = dataclasses.replace(engine_config, cache=cache)
        scheduler = engine_config.scheduler
        if scheduler.prefill_step_tokens is None and self.prefill_step_tokens is not None:
            scheduler = dataclasses.replace(scheduler, prefill_step_tokens=self.prefill_step_tokens)
            engine_config = dataclasses.replace(engine_config, scheduler=scheduler)
        self.engine_config = engine_config
        self.model_dir = model_dir
        # Latencies of the requests it serves and of its transfers (Prometheus).
        self.metrics = metrics or ServingMetrics()
        self._thread: EngineThread | None = None
        self._engine: LLMEngine | None = None
        self.grpc: GrpcServer | None = None
        self._guide_workers: GuideWorkers | None = None  # started with the first guide

    async def start(self) -> None:
        raise NotImplementedError

    async def _start_engine(self, name: str) -> LLMEngine:
        # Admission is limited where clients send requests; prefill takes what decode sends, and
        # starts each prompt at once: its KV reaches decode sooner than a gathered batch's would.
        cfg, limited = self.config, self.accepts_requests
        thread = EngineThread(
            lambda: LLMEngine(self.engine_config, self.model_dir),  # built on its own thread
            name,
            cfg.max_pending if limited else None,
            cfg.max_waiting if limited else None,
            ADMIT_WINDOW_S if limited else 0.0,
        )
        self._thread = thread  # before the wait: a stop during the build still ends the thread
        engine = await asyncio.wrap_future(thread.build())
        self._engine = engine
        return engine

    @property
    def engine_thread(self) -> EngineThread:
        assert self._thread is not None, "node not started"
        return self._thread

    @property
    def _started_engine(self) -> LLMEngine:
        assert self._engine is not None, "node not started"
        return self._engine

    # ---- what the API and the services use (any thread) ----------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self._started_engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._started_engine.max_model_len

    def submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        on_output: OutputCallback,
        options: RequestOptions | None = None,
    ) -> Future[None]:
        return self.engine_thread.submit(request_id, prompt, params, on_output, options)

    def abort(self, request_id: str, failure: Failure | None = None) -> None:
        self.engine_thread.abort(request_id, failure)

    @property
    def reader_idle_timeout_s(self) -> float:
        return self.config.reader_idle_timeout_s

    @property
    def request_timeout_s(self) -> float:
        return self.config.request_timeout_s

    def snapshot(self) -> NodeSnapshot:
        snap = self.engine_thread.snapshot()
        refused = None
        if self.grpc is not None and self.grpc.auth is not None:
            refused = {"refused": self.grpc.auth.refused}
        return dataclasses.replace(
            snap, threads=threading.active_count(), grpc_unauthenticated=refused
        )

    def _fingerprint(self, engine: LLMEngine) -> pb.ModelFingerprint:
        """What a peer must share with this node for their KV to be interchangeable."""
        return node_fingerprint(
            self.engine_config, engine.model_config, self.model_dir, self.config
        )

    def _grpc_server(self) -> GrpcServer:
        cfg = self.config
        return GrpcServer(
            cfg.grpc_host, cfg.port, cfg.max_concurrent_rpcs, cfg.cluster_secret, cfg.tls
        )

    def knows_prefill(self, address: str) -> bool:
        """Whether `address` is one of this node's prefill nodes (a router may name it)."""
        return False

    async def readdress_prefill(self, old: str, new: str) -> bool:
        """Call the prefill node at `old` at `new` from now on; whether `old` was one."""
        return False

    migration_address = ""  # no streams move live from here (a decode node's do)

    async def migrate_out(self, request_ids: list[str]) -> list[str]:
        """Pause streams for another node: only a decode node does (its KV goes over TCP)."""
        return []

    def kv_events(self) -> KVEventLog:
        return self._started_engine.kv_events

    async def compile_guide(self, guide: Guide) -> None:
        """Compile a structured-output guide in a worker process (bounded in time; a crash
        takes only the worker) so that the engine thread finds it compiled. Raises GuideError."""
        grammars = await asyncio.to_thread(self._started_engine.grammars)
        if grammars.has(guide):
            return
        if self._guide_workers is None:
            info = await asyncio.to_thread(grammars.info.serialize_json)
            self._guide_workers = GuideWorkers(info)
        compiled = await self._guide_workers.compile(guide)
        await asyncio.to_thread(grammars.add_compiled, guide, compiled)

    def health(self) -> tuple[bool, str]:
        """Unhealthy while starting, and for good once its tensor-parallel group broke (every
        step fails then: a router stops sending requests, an orchestrator restarts it)."""
        if self._engine is None:
            return False, "starting"
        tp = self._engine.tp
        if tp is not None and tp.broken:
            return False, tp.broken
        return True, "ok"

    def endpoints(self) -> list[str]:
        """What the node listens on, for its "ready" line."""
        return [f"grpc={self.grpc.address}"] if self.grpc is not None else []

    async def _stop_engine(self) -> None:
        """The engine first: calls in flight end with "the node is shutting down"."""
        if self._thread is not None:
            await asyncio.to_thread(self._thread.stop)

    async def stop(self) -> None:
        await self._stop_engine()
        if self._guide_workers is not None:
            self._guide_workers.close()
        if self.grpc is not None:
            await self.grpc.stop()


def node_fingerprint(
    engine_config: EngineConfig, model: ModelConfig, model_dir: Path, config: NodeConfig
) -> pb.ModelFingerprint:
    """The fingerprint a node with these configs shows its peers (the probe compares them)."""
    kv_dtype = TORCH_DTYPES[engine_config.dtype]  # the KV cache's, as the engine allocates it
    block_size = engine_config.cache.block_size
    terms = NodeTerms(
        engine_config.dtype,
        block_size,
        engine_config.quantization,
        config.transfer_backend,
        kv_dtype=str(kv_dtype).removeprefix("torch."),
        block_bytes=layer_block_bytes(model, block_size, kv_dtype),
        kv_layout=kv_layout(model),
        tokenizer=tokenizer_digest(model_dir),
        deterministic=engine_config.deterministic,
        kv_checksum=config.kv_checksum,
        kernels=deterministic_kernels(TORCH_DTYPES[engine_config.dtype])
        if engine_config.deterministic
        else "",
    )
    return fingerprint(model, terms)
