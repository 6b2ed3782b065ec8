"""`TracedRequests` (pure ASGI middleware, installed only when tracing is on): one span per
generation request, from its first byte to its response's last (a stream: its last event),
child of the client's `traceparent` if it sent one. The span waits in the request's state
(`trace`) for the handler, which parents what it starts on it (the router's forward, the
decode's prefill call); at the end the request's `Run`, if one ran here, records its stages on
it (`Run.trace_stages`), and a status of 400 or more marks it failed with the typed reason."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve import tracing
from pdserve.api.access import ResponseEnd

if TYPE_CHECKING:
    from pdserve.api.guard import ASGIApp, Receive, Scope, Send

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def request_span(state: Any) -> tracing.Span:
    """The span `TracedRequests` left in a request's state (`NOT_TRACED` if none)."""
    return getattr(state, "trace", tracing.NOT_TRACED)


class TracedRequests:
    def __init__(self, app: ASGIApp, name: str, paths: tuple[str, ...] = GENERATION_PATHS) -> None:
        self.app = app
        self.name = name
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in self.paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        parent = headers.get(tracing.TRACEPARENT.encode())
        span = tracing.start(
            self.name,
            parent.decode("latin-1") if parent else None,
            tracing.Kind.SERVER,
            {"http.request.method": str(scope.get("method")), "url.path": str(scope["path"])},
        )
        scope.setdefault("state", {})["trace"] = span
        end = ResponseEnd(send, lambda status: self._end(scope, span, status or 499))
        try:
            await self.app(scope, receive, end.send)
        finally:
            end.close()  # the client went away, or the app failed before its last byte

    @staticmethod
    def _end(scope: Scope, span: tracing.Span, status: int) -> None:
        span.set({"http.response.status_code": status})
        run = scope["state"].get("run")
        reason = run.trace_stages(span) if run is not None else None
        if status >= 400 or reason is not None:
            span.fail(reason or f"http_{status}", f"answered {status}")
        span.end()
