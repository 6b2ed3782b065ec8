"""The OpenAI-compatible HTTP app (FastAPI): /v1/completions, /v1/chat/completions (both with
`stream: true` as server-sent events ending in `data: [DONE]`), /v1/models, /health, /metrics.

Each HTTP request becomes a `Run` on the node; a streaming client that disconnects is aborted
end to end (on decode: the prefill call cancelled, blocks freed on both nodes). Errors are
OpenAI-style bodies whose status comes from the failure's reason (400 bad input, 503 overload
or an unavailable peer, 504 deadline); never a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve import tracing
from pdserve.api.access import AccessLog
from pdserve.api.guard import Guard
from pdserve.api.handlers import Api
from pdserve.api.metrics import ServingMetrics
from pdserve.api.node import ServingNode
from pdserve.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    MigrateRequest,
    PrefillAddress,
    TokenizeRequest,
)
from pdserve.api.traces import TracedRequests
from pdserve.config import HttpConfig

logger = logging.getLogger(__name__)


def build_app(
    node: ServingNode, metrics: ServingMetrics, model_name: str, http: HttpConfig | None = None
) -> FastAPI:
    """The app; `http` supplies the API key, the open paths, the body limit and whether chat
    content may carry control tokens (defaults: none, /health and /metrics, 4 MiB, no)."""
    http = http or HttpConfig()
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    app.add_middleware(
        Guard,
        api_key=http.api_key,
        open_paths=http.open_paths,
        max_body_bytes=http.max_body_bytes,
        router_key=http.router_key,
    )
    app.add_middleware(AccessLog)  # outermost: sees refusals too
    if tracing.enabled():
        app.add_middleware(TracedRequests, name=f"pdserve.{node.role}.request")
    api = Api(node, metrics, model_name, http.trust_special_tokens, http.router_key is not None)
    metrics.collect_from(node.snapshot)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(APIError(message, param=".".join(loc) or None).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Malformed JSON, unknown paths, wrong methods: the same OpenAI body as every error.
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        err = APIError(str(exc.detail), exc.status_code, kind)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        err = APIError(f"internal error: {type(exc).__name__}: {exc}", 500, "server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await api.completions(req, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        return await api.chat(req, request)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return await api.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        return await api.detokenize(req)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
        }
        if node.accepts_requests:
            card["max_model_len"] = node.max_model_len
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        ok, why = node.health()
        body = {"status": "ok" if ok else "unavailable", "detail": why}
        return JSONResponse(body, 200 if ok else 503)

    @app.get("/kv_events")
    async def kv_events(
        request: Request, since: int = 0, epoch: str | None = None
    ) -> dict[str, Any]:
        """The prefix cache's changes after `since` (a router's prefix index follows them);
        keys as 32-digit hex. Behind the router key (else the API key): they reveal which
        prefixes are cached."""
        if http.router_key is not None and not getattr(request.state, "router", False):
            raise APIError("/kv_events is the router's: send the router key", 403)
        if not node.accepts_requests:
            raise APIError(f"this is a {node.role} node; its cache is not routed to", 404)
        c = node.kv_events().since(since, epoch)
        return {
            "epoch": c.epoch,
            "seq": c.seq,
            "reset": c.reset,
            "stored": [f"{k:032x}" for k in c.stored],
            "removed": [f"{k:032x}" for k in c.removed],
        }

    @app.post("/admin/prefill-address")
    async def prefill_address(req: PrefillAddress, request: Request) -> dict[str, Any]:
        """A prefill node of this decode restarted on another address (`pdserve cluster`'s
        router says so): calls go to `new` from now on. Behind the router key (else the API
        key); the new node must still prove the cluster secret."""
        if http.router_key is not None and not getattr(request.state, "router", False):
            raise APIError("/admin/prefill-address is the router's: send the router key", 403)
        if not await node.readdress_prefill(req.old, req.new):
            raise APIError(f"{req.old!r} is not a prefill node of this decode", 404, param="old")
        return {"old": req.old, "new": req.new}

    @app.post("/admin/migrate")
    async def migrate(req: MigrateRequest, request: Request) -> dict[str, Any]:
        """Pause the named streams (ids a router gave them) between two decode steps and hand
        them over: each one's stream ends here without [DONE], and the router resumes it on
        another decode, which fetches its KV from `address` instead of computing it. Streams
        not paused (still prefilling, finished, unknown; or none where this node sends no KV)
        are not named in `migrated`: the router moves them by recompute. Behind the router
        key (else the API key)."""
        if http.router_key is not None and not getattr(request.state, "router", False):
            raise APIError("/admin/migrate is the router's: send the router key", 403)
        migrated = await node.migrate_out(req.request_ids)
        return {"address": node.migration_address, "migrated": migrated}

    @app.get("/metrics")
    async def render_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
