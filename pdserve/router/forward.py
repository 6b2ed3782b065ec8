"""The router's forwarding of one request to a decode: the request's body as it came, the
answer streamed back as it comes, every wait bounded by the request's deadline (504, or an
error event once streaming), and a client that goes away closes the upstream connection, which
aborts the request on the decode. A decode that fails before any byte reached the client is
reported (None), so that the router retries another; one that fails mid-stream ends the stream
with an error event."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.api.protocol import APIError
from pdserve.api.sse import client_gone
from pdserve.engine.failure import CLIENT_CLOSED
from pdserve.router.policy import Node

logger = logging.getLogger(__name__)


def error_body(message: str, kind: str = "server_error") -> dict[str, Any]:
    return APIError(message, kind=kind).body()


def answer_headers(upstream: httpx.Response) -> dict[str, str]:
    """The decode's headers the client sees."""
    keep = ("content-type", "retry-after")
    return {k: v for k, v in upstream.headers.items() if k.lower() in keep}


class _ClientGone(Exception):
    pass


class _PastDeadline(Exception):
    pass


class Forwarder:
    """Sends an `Upstream` attempt through `client` (the router's forwarding pool); a decode
    that fails is told to `set_health(node, False)`. While a request is in flight its decode's
    and prefill's `in_flight` count it (the prefill's until the first byte of the answer)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        timeout_s: float,
        set_health: Callable[[Node, bool], None],
    ) -> None:
        self.client = client
        self.timeout_s = timeout_s  # --request-timeout, named in the 504
        self.set_health = set_health

    async def __call__(self, up: Upstream, client: Request, deadline: float) -> Response | None:
        """The decode's answer, or None when it failed before any byte reached the client."""
        held = [n for n in (up.decode, up.prefill) if n is not None]
        for n in held:
            n.in_flight += 1
        released: set[int] = set()

        def release(node: Node) -> None:
            if id(node) not in released:
                released.add(id(node))
                node.in_flight -= 1

        def release_all() -> None:
            for n in held:
                release(n)

        request = self.client.build_request(
            "POST", up.decode.name + up.path, content=up.raw, headers=up.headers
        )
        try:
            upstream = await _bounded(self.client.send(request, stream=True), client, deadline)
            if not up.stream:
                try:  # whole, so a failure here can be retried
                    content = await _bounded(upstream.aread(), client, deadline)
                finally:
                    await upstream.aclose()
                release_all()
                return Response(content, upstream.status_code, answer_headers(upstream))
        except httpx.PoolTimeout:  # the router's own limit (--max-connections), not the decode
            release_all()
            message = "the router is at its connection limit (--max-connections)"
            return JSONResponse(error_body(message), 503, {"retry-after": "1"})
        except httpx.HTTPError as e:
            release_all()
            logger.warning("decode %s failed before answering: %s", up.decode.name, e)
            self.set_health(up.decode, False)
            return None
        except _ClientGone:  # its upstream connection is closed: the decode aborts it
            release_all()
            return Response(status_code=CLIENT_CLOSED)
        except _PastDeadline:
            release_all()
            message = f"the request passed its deadline ({self.timeout_s} s)"
            return JSONResponse(error_body(message, "timeout"), 504)
        prefill = up.prefill
        first_byte = (lambda: release(prefill)) if prefill is not None else (lambda: None)
        return StreamingResponse(
            self._relay(upstream, up.decode, first_byte, release_all, deadline),
            upstream.status_code,
            answer_headers(upstream),
        )

    async def _relay(
        self,
        upstream: httpx.Response,
        decode: Node,
        first_byte: Callable[[], None],
        done: Callable[[], None],
        deadline: float,
    ) -> AsyncIterator[bytes]:
        chunks = upstream.aiter_raw()
        try:
            while True:
                try:
                    left = max(0.0, deadline - time.monotonic())
                    chunk = await asyncio.wait_for(anext(chunks), left)
                except StopAsyncIteration:
                    break
                first_byte()
                yield chunk
        except TimeoutError:
            message = f"the request passed its deadline ({self.timeout_s} s)"
            yield f"data: {json.dumps(error_body(message, 'timeout'))}\n\n".encode()
        except httpx.HTTPError as e:
            logger.warning("decode %s failed mid-stream: %s", decode.name, e)
            self.set_health(decode, False)
            message = f"the decode entrance failed mid-stream: {type(e).__name__}"
            yield f"data: {json.dumps(error_body(message))}\n\n".encode()
        finally:
            done()
            await upstream.aclose()


@dataclass(frozen=True)
class Upstream:
    """One attempt at a request: where it goes and what is sent."""

    decode: Node
    prefill: Node | None
    path: str
    raw: bytes
    headers: dict[str, str]
    stream: bool


async def _bounded(work: Awaitable[Any], client: Request, deadline: float) -> Any:
    """`work`'s result, unless the client goes away (`_ClientGone`) or the deadline passes
    (`_PastDeadline`) first: then `work` is cancelled (its connection closed)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(client_gone(client))
    try:
        left = max(0.0, deadline - time.monotonic())
        done, _ = await asyncio.wait({task, gone}, timeout=left, return_when="FIRST_COMPLETED")
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise _ClientGone() if gone in done else _PastDeadline()
