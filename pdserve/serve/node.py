"""One node in this process, assembled in one place: the node for its role (prefill, decode or
colocated `both`, `build_node`) built with the API's metrics, the HTTP API in front
when asked, a "ready" line naming what it listens on, and a clean stop on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve import tracing
from pdserve.api.metrics import ServingMetrics
from pdserve.config import EngineConfig, HttpConfig, NodeConfig
from pdserve.serve.decode_node import DecodeNode
from pdserve.serve.engine_node import EngineNode
from pdserve.serve.prefill_node import PrefillNode

if TYPE_CHECKING:
    from pdserve.serve.http import HttpServer

logger = logging.getLogger(__name__)


class ColocatedNode(EngineNode):
    """`--role both`: one engine does prefill and decode; no gRPC, no transfer. The baseline
    disaggregation is measured against."""

    role = "both"

    async def start(self) -> None:
        await self._start_engine("engine")
        self.engine_thread.start()


def build_node(
    role: str,
    engine_config: EngineConfig,
    model_dir: Path,
    config: NodeConfig,
    metrics: ServingMetrics | None = None,
) -> EngineNode:
    """The node for `role` (prefill, decode or both); nothing runs before its `start`."""
    kinds: dict[str, type[EngineNode]] = {
        "prefill": PrefillNode,
        "decode": DecodeNode,
        "both": ColocatedNode,
    }
    return kinds[role](engine_config, model_dir, config, metrics)


async def serve_node(
    role: str,
    engine_config: EngineConfig,
    model_dir: Path,
    config: NodeConfig,
    http: HttpConfig | None,
) -> None:
    """Run the node (with the HTTP API if `http`) until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tracing.setup(f"pdserve-{role}", config.otlp_traces_endpoint)
    metrics = ServingMetrics(http.served_model_name if http is not None else "")
    node = build_node(role, engine_config, model_dir, config, metrics)
    server: HttpServer | None = None
    try:
        await node.start()
        parts = node.endpoints()
        if http is not None:  # the HTTP stack is imported only by nodes that serve it
            from pdserve.api.routes import build_app
            from pdserve.serve.http import HttpServer

            # Chat templates render through transformers: loaded before the first request.
            await asyncio.to_thread(node.tokenizer.load_chat_template)
            app = build_app(node, metrics, http.served_model_name, http)
            server = HttpServer(app, http.host, http.port, http.tls)
            await server.start()
            scheme = "https" if http.tls.serves else "http"
            parts.insert(0, f"http={scheme}://{server.address}")
        print(f"pdserve {role} ready {' '.join(parts)}", flush=True)
        await stop.wait()
    finally:
        await node.stop()  # the engine first: requests in flight end with an error
        if server is not None:
            await server.stop()
