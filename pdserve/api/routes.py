"""The OpenAI-compatible HTTP app (FastAPI): /v1/completions, /v1/chat/completions (both with
`stream: true` as server-sent events ending in `data: [DONE]`), /v1/models, /health, /metrics.

Each HTTP request becomes a `Run` on the node; a streaming client that disconnects is aborted
end to end (on decode: the prefill call cancelled, blocks freed on both nodes). Errors are
OpenAI-style bodies whose status comes from the failure's reason (400 bad input, 503 overload
or an unavailable peer, 504 deadline); never a traceback.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.api.access import AccessLog
from pdserve.api.guard import Guard
from pdserve.api.metrics import ServingMetrics
from pdserve.api.node import ServingNode
from pdserve.api.protocol import (
    PREFILL_HEADER,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from pdserve.api.render import Renderer
from pdserve.api.run import Run, RunOptions
from pdserve.api.sse import stream_events
from pdserve.config import DEFAULT_MAX_TOKENS, HttpConfig
from pdserve.engine.failure import CLIENT_CLOSED
from pdserve.engine.sequence import LOCAL_PREFILL, SamplingError, SamplingParams
from pdserve.engine.structured import GuideError

logger = logging.getLogger(__name__)


class Api:
    def __init__(
        self,
        node: ServingNode,
        metrics: ServingMetrics,
        model_name: str,
        trust_special_tokens: bool = False,
        router_only: bool = False,
    ) -> None:
        self.node = node
        self.metrics = metrics
        self.model_name = model_name
        self.trust_special_tokens = trust_special_tokens
        self.router_only = router_only  # the prefill choice header needs the router key

    def _check_text_length(self, chars: int) -> None:
        """Refuse a text that cannot fit the context before paying to tokenize it."""
        node = self._serving()
        limit = node.max_model_len
        if chars > limit * node.tokenizer.max_token_chars:
            raise APIError(
                f"this model's maximum context length is {limit} tokens; the prompt has "
                f"{chars} characters, more than that many tokens can hold",
                param="prompt",
                code="context_length_exceeded",
            )

    def _serving(self) -> ServingNode:
        if not self.node.accepts_requests:
            raise APIError(f"this is a {self.node.role} node; send requests to decode", 404)
        return self.node

    def _params(self, req: SamplingFields, prompt_ids: list[int]) -> SamplingParams:
        self._check_model(req.model)
        try:
            params = req.sampling(DEFAULT_MAX_TOKENS)
        except SamplingError as e:
            raise APIError(str(e)) from e
        limit = self.node.max_model_len
        if len(prompt_ids) + params.max_tokens > limit:
            raise APIError(
                f"this model's maximum context length is {limit} tokens; the request has "
                f"{len(prompt_ids)} prompt tokens and asks for {params.max_tokens} more",
                param="max_tokens" if len(prompt_ids) < limit else "prompt",
                code="context_length_exceeded",
            )
        return params

    async def serve(
        self,
        req: SamplingFields,
        prompt_ids: list[int],
        chat: bool,
        http: Request,
        prompt_text: str | None = None,
    ) -> Response:
        node = self._serving()
        peer = http.headers.get(PREFILL_HEADER)
        if self.router_only and not getattr(http.state, "router", False):
            peer = None  # the prefill choice is the router's (its key) to make: ignored
        if peer is not None and peer != LOCAL_PREFILL and not node.knows_prefill(peer):
            raise APIError(f"{PREFILL_HEADER}: {peer!r} is not a prefill node of this decode")
        params = self._params(req, prompt_ids)
        if params.guide is not None:  # compiled here, off the engine thread and the loop
            try:
                await node.compile_guide(params.guide)
            except GuideError as e:
                raise APIError(str(e), param="response_format") from e
        candidates = req.n
        if isinstance(req, CompletionRequest) and req.best_of is not None:
            if req.best_of < req.n:
                raise APIError(f"best_of ({req.best_of}) must be >= n ({req.n})", param="best_of")
            if req.best_of > req.n and req.stream:
                raise APIError("best_of > n cannot be streamed", param="best_of")
            candidates = req.best_of
            params = replace(params, logprobs=True)  # ranked by their sum
        options = RunOptions(candidates, peer, req.cache_salt)
        run = Run(node, self.metrics, prompt_ids, params, options)
        http.state.run = run  # for the access log
        await run.start()  # the prompt was checked: its ids can be decoded
        echo = ""
        if isinstance(req, CompletionRequest) and req.echo:
            echo = prompt_text if prompt_text is not None else node.tokenizer.decode(prompt_ids)
        render = Renderer(node.tokenizer, self.model_name, chat, echo)
        if req.stream:
            events = stream_events(
                run, render, req.wants_logprobs, req.include_usage, req.continuous_usage
            )
            return StreamingResponse(events, media_type="text/event-stream")
        drained = asyncio.ensure_future(asyncio.gather(*(run.drain(c) for c in run.choices)))
        gone = asyncio.ensure_future(client_gone(http))
        waits: list[asyncio.Future[Any]] = [drained, gone]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if not drained.done():  # nobody will read the answer: stop computing it
            logger.info("request %s: client went away; aborting", run.id)
            drained.cancel()
            await run.abort()
            return Response(status_code=CLIENT_CLOSED)
        gone.cancel()
        outputs = list(drained.result())
        if candidates > req.n:  # best_of: the n with the highest cumulative logprob
            outputs = sorted(outputs, key=lambda o: -sum(o.logprobs))[: req.n]
        return JSONResponse(render.response(run, outputs, req.wants_logprobs))

    async def completions(self, req: CompletionRequest, http: Request) -> Response:
        prompt = req.prompt
        if isinstance(prompt, list):
            ids = list(prompt)
        else:
            self._check_text_length(len(prompt))
            # Off the event loop: a long prompt must not stall other requests' streams.
            ids = await asyncio.to_thread(self._serving().tokenizer.encode, prompt)
        return await self.serve(req, ids, False, http, prompt if isinstance(prompt, str) else None)

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        node = self._serving()
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if req.prompt is not None:
            self._check_text_length(len(req.prompt))
            ids = await asyncio.to_thread(node.tokenizer.encode, req.prompt)
        else:
            ids = await self._chat_ids(req.messages or [])
        return {"count": len(ids), "max_model_len": node.max_model_len, "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        node = self._serving()
        if len(req.tokens) > node.max_model_len:  # no model output is longer: a bounded answer
            raise APIError(
                f"at most {node.max_model_len} token ids (the context length), "
                f"got {len(req.tokens)}",
                param="tokens",
            )
        vocab = node.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is outside the vocabulary", param="tokens")
        text = await asyncio.to_thread(node.tokenizer.decode, req.tokens, False)
        return {"prompt": text}

    async def _chat_ids(self, chat: list[ChatMessage]) -> list[int]:
        """The conversation's token ids with the generation prompt, tokenized off the loop."""
        messages = [m.model_dump(exclude_none=True) for m in chat]
        self._check_text_length(sum(len(str(m.get("content") or "")) for m in messages))
        template = self._serving().tokenizer.apply_chat_template
        try:
            return await asyncio.to_thread(template, messages, self.trust_special_tokens)
        except ValueError as e:
            raise APIError(str(e)) from e

    async def chat(self, req: ChatCompletionRequest, http: Request) -> Response:
        return await self.serve(req, await self._chat_ids(req.messages), True, http)


async def client_gone(http: Request) -> None:
    """Returns when the client disconnects (its body has been read, so the next ASGI message
    is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


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

    @app.get("/metrics")
    async def render_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
