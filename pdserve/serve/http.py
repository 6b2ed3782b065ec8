"""The HTTP server of a node: uvicorn running the API app in the node's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from pdserve.config import TlsFiles

START_TIMEOUT_S = 5.0
TICK_S = 1.0


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (the node owns SIGINT/SIGTERM), and with a main
    loop that wakes once a second, not ten times: on a machine whose cores all run the engine,
    each wake-up of the event loop preempts a compute thread. It refreshes the Date header
    (one-second resolution) on each tick, and `stop` ends it at once."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.exit_now = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:
        pass

    async def main_loop(self) -> None:
        while not await self.on_tick(0):  # counter 0: the Date header is refreshed every tick
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.exit_now.wait(), TICK_S)


class HttpServer:
    def __init__(self, app: FastAPI, host: str, port: int, tls: TlsFiles | None = None) -> None:
        serves_tls = tls is not None and tls.serves
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,
            ssl_certfile=tls.cert if tls is not None and serves_tls else None,
            ssl_keyfile=tls.key if tls is not None and serves_tls else None,
        )
        self.server = _Server(config)
        self.task: asyncio.Task[None] | None = None
        self.address = ""

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve())
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises the bind error
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("the HTTP server did not start")
            await asyncio.sleep(0.01)
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        self.address = f"{host}:{port}"

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        self.server.exit_now.set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.task, 5)
