"""Puts the HTTP API in front of a node: an in-loop uvicorn server, and what each role
reports to /health and /metrics. Also the colocated node (`--role both`): one engine doing
prefill and decode, the baseline disaggregation is measured against."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from pdserve.api.metrics import NodeSnapshot, ServingMetrics
from pdserve.api.server import ServingBackend, build_app
from pdserve.config import EngineConfig
from pdserve.disagg.decode_server import DecodeNode
from pdserve.disagg.prefill_server import PrefillNode
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the node owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:
        pass


class HttpServer:
    def __init__(self, backend: ServingBackend, host: str, port: int) -> None:
        config = uvicorn.Config(
            build_app(backend),
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self.server = _Server(config)
        self.task: asyncio.Task[None] | None = None
        self.address = ""

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve())
        for _ in range(500):
            if self.server.started:
                break
            if self.task.done():
                self.task.result()  # raises the bind error
            await asyncio.sleep(0.01)
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        self.address = f"{host}:{port}"

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.task, 5)


def engine_snapshot(engine: LLMEngine) -> NodeSnapshot:
    s = engine.scheduler
    pool = engine.pool
    stats = s.stats
    hit = stats.cached_prompt_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
    return NodeSnapshot(
        gauges={
            "num_requests_running": len(s.running),
            "num_requests_waiting": len(s.waiting),
            "num_requests_waiting_for_kv": len(s.waiting_for_kv),
            "kv_blocks_used": pool.num_used,
            "kv_blocks_free": pool.num_free,
            "kv_blocks_total": pool.num_blocks,
            "prefix_cache_hit_rate": hit,
        },
        counters={"preemptions": {"recompute": stats.num_preemptions}},
    )


def decode_backend(node: DecodeNode, model_name: str, max_pending: int) -> ServingBackend:
    def health() -> tuple[bool, str]:
        if node.client is None or node.engine_thread_ is None:
            return False, "starting"
        if not node.client.has_verified():
            return False, "no prefill node reachable"
        return True, "ok"

    def snapshot() -> NodeSnapshot:
        snap = engine_snapshot(node.engine)
        sizes = node.store.sizes()
        loader = node.loader
        snap.gauges.update(
            resource_store_entries=sizes["entries"],
            side_channel_entries=sizes["side_channel"],
            tombstones=sizes["tombstones"],
            pending_transfers=loader.num_pending if loader else 0,
        )
        snap.counters["transfer_bytes"] = {"received": node.store.bytes_received}
        snap.counters["frames_rejected"] = dict(node.store.frames_rejected)
        snap.counters["transfer_failures"] = dict(loader.failures) if loader else {}
        snap.counters["not_split"] = dict(loader.not_split) if loader else {}
        return snap

    def wire(metrics: ServingMetrics) -> None:
        if node.loader is not None:
            node.loader.on_handoff = metrics.transfer_request.observe
        if node.receiver is not None:
            node.receiver.on_frame = metrics.transfer_layer.observe

    return ServingBackend(
        node.engine_thread, model_name, "decode", health, snapshot, max_pending, on_metrics=[wire]
    )


def prefill_backend(node: PrefillNode, model_name: str) -> ServingBackend:
    def snapshot() -> NodeSnapshot:
        snap = engine_snapshot(node.engine)
        sender = node.sender
        sizes = sender.sizes()
        snap.gauges.update(pending_transfers=sizes["sending"], held_for_send=sizes["held"])
        snap.counters["transfer_bytes"] = {"sent": sender.sender.bytes_sent}
        snap.counters["transfer_failures"] = dict(sender.failures)
        return snap

    return ServingBackend(None, model_name, "prefill", lambda: (True, "ok"), snapshot)


class ColocatedNode:
    """`--role both`: one engine does prefill and decode; no gRPC, no transfer."""

    def __init__(self, engine_config: EngineConfig, model_dir: Path) -> None:
        self.engine_config = engine_config
        self.model_dir = model_dir
        self.engine_thread_: EngineThread | None = None

    async def start(self) -> None:
        engine = await asyncio.to_thread(LLMEngine, self.engine_config, self.model_dir)
        self.engine_thread_ = EngineThread(engine, "engine")
        self.engine_thread_.start()

    def backend(self, model_name: str, max_pending: int) -> ServingBackend:
        thread = self.engine_thread_
        assert thread is not None
        return ServingBackend(
            thread,
            model_name,
            "both",
            lambda: (True, "ok"),
            lambda: engine_snapshot(thread.engine),
            max_pending,
        )

    async def stop(self) -> None:
        if self.engine_thread_ is not None:
            await asyncio.to_thread(self.engine_thread_.stop)
