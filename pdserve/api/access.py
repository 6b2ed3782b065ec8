"""Access logs and log formats. `AccessLog` (pure ASGI middleware) writes one record per HTTP
request when its response has been sent in full (a stream: at its last byte) on the
`pdserve.access` logger: method, path, status, duration, and for generation requests the
request id, prompt / completion / cached tokens, TTFT and its stages (queueing, prefill
compute, exposed transfer, decode admission) from the request's `Run` (which the handler leaves
in the request's state), as the `access` attribute of the record (what
`serve/logs.py`'s JSON format writes as keys). The path is written with control characters
escaped (`\\x0a`): a client's percent-encoded newline cannot forge a log line."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: the logging set-up imports this module, not the HTTP stack
    from pdserve.api.guard import ASGIApp, Message, Receive, Scope, Send

access_logger = logging.getLogger("pdserve.access")
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)}


def printable(text: str) -> str:
    """`text` with its control characters (newlines, escapes, DEL) written as `\\xNN`."""
    return text.translate(_CONTROL)


class ResponseEnd:
    """An ASGI `send` passed on (`send`) that calls `on_end(status)` once: after the
    response's last byte, or at `close` (status 0 if none was sent) if that never came."""

    def __init__(self, send: Send, on_end: Callable[[int], None]) -> None:
        self._send = send
        self.on_end = on_end
        self.status = 0
        self.ended = False

    async def send(self, message: Message) -> None:
        await self._send(message)
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
        elif message["type"] == "http.response.body" and not message.get("more_body"):
            self.close()

    def close(self) -> None:
        if not self.ended:
            self.ended = True
            self.on_end(self.status)


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        end = ResponseEnd(send, lambda status: self._log(scope, status, time.monotonic() - start))
        try:
            await self.app(scope, receive, end.send)
        finally:
            end.close()  # the client went away, or the app failed before its last byte

    @staticmethod
    def _log(scope: Scope, status: int, seconds: float) -> None:
        fields: dict[str, Any] = {
            "method": scope.get("method"),
            "path": printable(str(scope.get("path", ""))),
            "status": status,
            "duration_s": round(seconds, 6),
        }
        client = scope.get("client")
        if client:
            fields["client"] = f"{client[0]}:{client[1]}"
        run = (scope.get("state") or {}).get("run")
        if run is not None:
            usage = run.usage()
            fields.update(
                request_id=run.id,
                prompt_tokens=usage["prompt_tokens"],
                completion_tokens=usage["completion_tokens"],
                cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
                ttft_s=None if run.first_at is None else round(run.first_at - run.start_at, 6),
            )
            if run.timing is not None:  # where the TTFT went, stage by stage (api/timing.py)
                fields["ttft_stages"] = {
                    k: round(v, 6) for k, v in run.timing.items() if k != "ttft"
                }
        text = " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("method", "path"))
        access_logger.info(
            "%s %s %s", fields["method"], fields["path"], text, extra={"access": fields}
        )
