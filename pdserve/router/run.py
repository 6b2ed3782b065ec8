"""The router's process: the app under uvicorn in one event loop, a "ready" line naming its
address, a clean stop on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import signal

from pdserve import tracing
from pdserve.router.app import Router, RouterConfig
from pdserve.serve.http import HttpServer


async def serve_router(config: RouterConfig, host: str, port: int) -> None:
    tracing.setup("pdserve-router", config.otlp_traces_endpoint)
    router = Router(config)
    server = HttpServer(router.app, host, port, router.config.tls)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await router.start()
        await server.start()
        print(f"pdserve router ready http={server.address}", flush=True)
        await stop.wait()
    finally:
        await server.stop()
        await router.stop()
