"""What every HTTP request passes before the app sees it (pure ASGI middleware): the API key
(`Authorization: Bearer KEY`, like vLLM's `--api-key`; 401 otherwise, except on the open
paths; with a router key, that key too, and the request is then marked as the router's in
`scope["state"]["router"]`, which alone may read /kv_events and choose the prefill node) and
the body size limit (413 once a body, declared or streamed, exceeds it; the rest is
never read), and the body's deadline (408 when it has not all arrived `body_timeout_s` after
its head: a slow sender cannot hold a request open). All answer with OpenAI error bodies."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pdserve.api.protocol import APIError
from pdserve.config import DEFAULT_HTTP_BODY_TIMEOUT_S, Secret

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def _reply(send: Send, error: APIError, extra: list[tuple[bytes, bytes]]) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers + extra})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        api_key: Secret | None,
        open_paths: tuple[str, ...],
        max_body_bytes: int,
        body_timeout_s: float = DEFAULT_HTTP_BODY_TIMEOUT_S,
        router_key: Secret | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.router_key = router_key
        self.open_paths = open_paths
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    def _authorized(self, scope: Scope) -> bool:
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if self.router_key is not None and hmac.compare_digest(
            given, b"Bearer " + self.router_key.value
        ):
            scope.setdefault("state", {})["router"] = True
            return True
        if self.api_key is None or scope.get("path") in self.open_paths:
            return True
        return hmac.compare_digest(given, b"Bearer " + self.api_key.value)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            error = APIError(
                "invalid or missing API key (send 'Authorization: Bearer KEY')",
                401,
                "authentication_error",
                code="invalid_api_key",
            )
            await _reply(send, error, [(b"www-authenticate", b"Bearer")])
            return
        too_large = APIError(
            f"request body larger than {self.max_body_bytes} bytes", 413, code="body_too_large"
        )
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _reply(send, too_large, [(b"connection", b"close")])
            return
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read_body(receive)
        except TimeoutError:
            slow = APIError(
                f"the request body did not arrive within {self.body_timeout_s} s",
                408,
                code="body_timeout",
            )
            await _reply(send, slow, [(b"connection", b"close")])
            return
        if body is None:
            await _reply(send, too_large, [(b"connection", b"close")])
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it exceeds the limit (a chunked body declares
        no length)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # disconnected: the app sees an empty body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body in one message, then the client's later messages (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
