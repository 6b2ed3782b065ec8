"""The HTTP server of a node (and of the router): uvicorn running the app in the process's own
event loop, with the limits a server facing clients needs: a request's head must arrive within
`receipt_timeout_s` of the connection (or of the previous response) however slowly it trickles
in (slowloris), idle keep-alive connections close after `keep_alive_s`, and beyond
`max_concurrency` connections or requests in flight new requests get 503 (uvicorn's
`limit_concurrency`): `HttpLimits`. The body's own deadline is the `Guard`'s."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.config import (
    DEFAULT_HTTP_KEEP_ALIVE_S,
    DEFAULT_HTTP_MAX_CONCURRENCY,
    DEFAULT_HTTP_RECEIPT_TIMEOUT_S,
    TlsFiles,
)

START_TIMEOUT_S = 5.0
TICK_S = 1.0


def receipt_bounded(receipt_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol that closes a connection whose request head is not complete
    `receipt_timeout_s` after the connection opened or its previous response ended."""

    class Protocol(H11Protocol):
        _receipt: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn narrows the base's BaseTransport
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # a request's head is complete
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's head: within the same limit

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._receipt = self.loop.call_later(receipt_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._receipt is not None:
                self._receipt.cancel()
                self._receipt = None

        def _expired(self) -> None:
            self._receipt = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return Protocol


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


@dataclass(frozen=True)
class HttpLimits:
    receipt_timeout_s: float = DEFAULT_HTTP_RECEIPT_TIMEOUT_S
    keep_alive_s: float = DEFAULT_HTTP_KEEP_ALIVE_S
    max_concurrency: int = DEFAULT_HTTP_MAX_CONCURRENCY


class HttpServer:
    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        tls: TlsFiles | None = None,
        limits: HttpLimits = HttpLimits(),
    ) -> None:
        serves_tls = tls is not None and tls.serves
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http=receipt_bounded(limits.receipt_timeout_s),
            timeout_keep_alive=int(max(1, limits.keep_alive_s)),
            limit_concurrency=limits.max_concurrency,
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
