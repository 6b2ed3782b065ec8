"""gRPC serving between nodes: a server that can be stopped whatever started (token
authentication with a cluster secret, TLS with a certificate), the bound on generation calls
served at once, and a call ended with the status its failure's reason maps to."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from pdserve.config import Secret, TlsFiles
from pdserve.disagg.auth import ServerAuth, server_credentials
from pdserve.disagg.wire import SERVER_OPTIONS, grpc_code
from pdserve.engine.failure import Failure, FailureReason

# Calls beyond the generation limit that gRPC still serves: probes and stats of a busy node
# answer instead of being refused with its generation calls.
CONTROL_CALLS = 64


async def abort_with(context: grpc.aio.ServicerContext, failure: Failure, where: str) -> NoReturn:
    text = str(failure)  # the engine's own messages may name the request already
    await context.abort(
        grpc_code(failure.reason), text if text.startswith(where) else f"{where}: {text}"
    )
    raise AssertionError("unreachable: abort raises")


class CallSlots:
    """Bounds the generation calls (Prefill, Generate) a node serves at once: one more is
    refused as overloaded (RESOURCE_EXHAUSTED), which decode answers by prefilling locally.
    Event loop only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    @contextlib.asynccontextmanager
    async def hold(self, context: grpc.aio.ServicerContext, where: str) -> AsyncIterator[None]:
        if self.active >= self.limit:
            message = f"{self.limit} calls in progress (--max-concurrent-rpcs)"
            failure = Failure(FailureReason.OVERLOADED, message, "admission")
            await abort_with(context, failure, where)
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1


class GrpcServer:
    """A grpc.aio server on host:port (port 0: a free one); `stop` is safe before `start`.
    With a cluster secret every call must carry a valid token (UNAUTHENTICATED otherwise);
    with a certificate and key it speaks TLS. The services bound their generation calls to
    `max_generation_calls` (CallSlots); gRPC itself refuses any call past that plus
    CONTROL_CALLS."""

    def __init__(
        self,
        host: str,
        port: int,
        max_generation_calls: int,
        secret: Secret | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        self.auth = ServerAuth(secret) if secret is not None else None
        self.server: grpc.aio.Server | None = grpc.aio.server(
            options=SERVER_OPTIONS,
            maximum_concurrent_rpcs=max_generation_calls + CONTROL_CALLS,
            interceptors=[self.auth] if self.auth is not None else None,
        )
        if tls is not None and tls.serves:
            self.port = self.server.add_secure_port(f"{host}:{port}", server_credentials(tls))
        else:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        self.address = f"{host}:{self.port}"
        self.started = False

    async def start(self) -> None:
        assert self.server is not None
        await self.server.start()
        self.started = True

    async def stop(self, grace: float = 1.0) -> None:
        if self.server is not None and self.started:
            await self.server.stop(grace)
        self.server = None
