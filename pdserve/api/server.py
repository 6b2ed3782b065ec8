"""The OpenAI-compatible HTTP server (FastAPI): /v1/completions, /v1/chat/completions (both with
`stream: true` as server-sent events ending in `data: [DONE]`), /v1/models, /health, /metrics.

Each HTTP request becomes one engine request per choice (`n`), submitted to the node's engine
thread; outputs come back through an asyncio queue. A streaming client that disconnects is
aborted end to end (on decode: the prefill call cancelled, blocks freed on both nodes). Errors
are OpenAI-style bodies: 400 for bad input, 503 for overload or an unavailable peer; never a
traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.api.metrics import NodeSnapshot, ServingMetrics
from pdserve.api.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields
from pdserve.disagg.timing import STAGES, ttft_breakdown
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.llm_engine import RequestError, RequestOutput
from pdserve.engine.sequence import SamplingError, SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16


@dataclass
class ServingBackend:
    """What the API needs from a node."""

    engine_thread: EngineThread | None  # None: this node serves no generation (prefill)
    model_name: str
    role: str
    health: Callable[[], tuple[bool, str]]
    snapshot: Callable[[], NodeSnapshot]
    max_pending: int = 256  # requests in the engine beyond which new ones get 503
    local_only_n: bool = True  # n > 1 is served without disaggregation
    on_metrics: list[Callable[[ServingMetrics], None]] = field(default_factory=list)


@dataclass
class _Choice:
    index: int
    request_id: str
    queue: asyncio.Queue[RequestOutput]
    final: RequestOutput | None = None
    sent_tokens: int = 0


class _Run:
    """One HTTP request's engine requests and their timing."""

    def __init__(self, app: App, prompt_ids: list[int], params: SamplingParams, n: int) -> None:
        self.app = app
        self.prompt_ids = prompt_ids
        self.created = int(time.time())
        self.id = uuid.uuid4().hex[:24]
        self.start = time.monotonic()
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.choices: list[_Choice] = []
        self.params = params
        self.n = n
        self.timing: dict[str, float] | None = None  # TTFT breakdown of the first choice

    async def submit(self) -> None:
        thread = self.app.engine_thread
        loop = asyncio.get_running_loop()
        for i in range(self.n):
            params = self.params
            if self.n > 1 and params.seed is not None:
                params = replace(params, seed=params.seed + i)
            choice = _Choice(i, f"{self.id}-{i}", asyncio.Queue())

            def deliver(out: RequestOutput, q: asyncio.Queue[RequestOutput] = choice.queue) -> None:
                loop.call_soon_threadsafe(q.put_nowait, out)

            extras: dict[str, Any] = {"local": self.n > 1}
            try:
                await asyncio.wrap_future(
                    thread.submit(choice.request_id, self.prompt_ids, params, deliver, extras)
                )
            except (RequestError, SamplingError, ValueError) as e:
                await self.abort()
                raise APIError(str(e)) from e
            self.choices.append(choice)

    async def next(self, choice: _Choice) -> RequestOutput:
        out = await choice.queue.get()
        now = time.monotonic()
        metrics = self.app.metrics
        new_tokens = len(out.token_ids) - choice.sent_tokens
        if new_tokens > 0:
            if self.first_at is None:
                self.first_at = now
                metrics.ttft.observe(now - self.start)
                if out.timings and "arrived" in out.timings:
                    self.timing = ttft_breakdown(out.timings, time.time())
                    for stage in STAGES:
                        metrics.ttft_stage.labels(stage).observe(max(0.0, self.timing[stage]))
            elif self.last_at is not None:
                metrics.itl.observe(now - self.last_at)
            self.last_at = now
        if out.finished:
            choice.final = out
            metrics.requests.labels(out.finish_reason or "unknown").inc()
            if all(c.final is not None for c in self.choices):
                metrics.e2e.observe(now - self.start)
        return out

    async def abort(self) -> None:
        for c in self.choices:
            if c.final is None:
                self.app.engine_thread.abort(c.request_id)

    def usage(self) -> dict[str, int]:
        completion = sum(len(c.final.token_ids) for c in self.choices if c.final is not None)
        prompt = len(self.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }


def _raise_for(out: RequestOutput) -> None:
    if out.error is not None:
        raise APIError(out.error, status=503, kind="server_error", code="unavailable")


class App:
    def __init__(self, backend: ServingBackend) -> None:
        self.backend = backend
        self.metrics = ServingMetrics(backend.snapshot)
        for hook in backend.on_metrics:
            hook(self.metrics)

    @property
    def engine_thread(self) -> EngineThread:
        if self.backend.engine_thread is None:
            raise APIError(f"this is a {self.backend.role} node; send requests to decode", 404)
        return self.backend.engine_thread

    # ---- request preparation ------------------------------------------------------------

    def _check(self, req: SamplingFields, prompt_ids: list[int]) -> SamplingParams:
        if req.model != self.backend.model_name:
            raise APIError(
                f"model {req.model!r} does not exist; "
                f"this server serves {self.backend.model_name!r}",
                param="model",
                code="model_not_found",
            )
        engine = self.engine_thread.engine
        logprobs = bool(getattr(req, "logprobs", None))
        try:
            params = req.sampling(DEFAULT_MAX_TOKENS, logprobs)
        except SamplingError as e:
            raise APIError(str(e)) from e
        limit = engine.max_model_len
        if len(prompt_ids) + params.max_tokens > limit:
            raise APIError(
                f"this model's maximum context length is {limit} tokens; the request has "
                f"{len(prompt_ids)} prompt tokens and asks for {params.max_tokens} more",
                param="max_tokens" if len(prompt_ids) < limit else "prompt",
                code="context_length_exceeded",
            )
        if len(engine.requests) >= self.backend.max_pending:
            raise APIError(
                "the server is overloaded; retry later", 503, "server_error", code="overloaded"
            )
        return params

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        return self.engine_thread.engine.tokenizer.encode(prompt)

    def _token_text(self, token: int) -> str:
        return self.engine_thread.engine.tokenizer.decode([token], skip_special_tokens=False)

    # ---- endpoints ----------------------------------------------------------------------

    async def _start(self, req: SamplingFields, prompt_ids: list[int]) -> _Run:
        run = _Run(self, prompt_ids, self._check(req, prompt_ids), req.n)
        await run.submit()
        return run

    def _response(self, run: _Run, kind: str, choices: list[dict[str, Any]]) -> JSONResponse:
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        return JSONResponse(
            {
                "id": f"{prefix}-{run.id}",
                "object": kind,
                "created": run.created,
                "model": self.backend.model_name,
                "choices": choices,
                "usage": run.usage(),
                "pdserve_timing": run.timing,
            }
        )

    async def completions(self, req: CompletionRequest, http: Request) -> Response:
        run = await self._start(req, self._prompt_ids(req.prompt))
        if req.stream:
            return self._stream(run, req, http, chat=False)
        choices = []
        for c in run.choices:
            out = await self._drain(run, c)
            logprobs = (
                self._completion_logprobs(out.token_ids, out.logprobs)
                if req.logprobs is not None
                else None
            )
            choices.append(
                {
                    "index": c.index,
                    "text": out.text,
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                }
            )
        return self._response(run, "text_completion", choices)

    async def chat(self, req: ChatCompletionRequest, http: Request) -> Response:
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            prompt_ids = self.engine_thread.engine.tokenizer.apply_chat_template(messages)
        except ValueError as e:
            raise APIError(str(e)) from e
        run = await self._start(req, prompt_ids)
        if req.stream:
            return self._stream(run, req, http, chat=True)
        choices = []
        for c in run.choices:
            out = await self._drain(run, c)
            logprobs = self._chat_logprobs(out.token_ids, out.logprobs) if req.logprobs else None
            choices.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": out.text},
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                }
            )
        return self._response(run, "chat.completion", choices)

    async def _drain(self, run: _Run, choice: _Choice) -> RequestOutput:
        try:
            while True:
                out = await run.next(choice)
                if out.finished:
                    _raise_for(out)
                    return out
        except BaseException:
            await run.abort()
            raise

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
        tokens = [self._token_text(t) for t in token_ids]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": None,
            "text_offset": offsets,
        }

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
        content = []
        for t, lp in zip(token_ids, logprobs, strict=False):
            text = self._token_text(t)
            content.append(
                {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            )
        return {"content": content}

    def _stream(
        self, run: _Run, req: SamplingFields, http: Request, chat: bool
    ) -> StreamingResponse:
        kind = "chat.completion.chunk" if chat else "text_completion"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{run.id}"
        want_logprobs = bool(getattr(req, "logprobs", None))

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
            body: dict[str, Any] = {
                "id": rid,
                "object": kind,
                "created": run.created,
                "model": self.backend.model_name,
                "choices": choices,
            }
            if usage is not None:
                body["usage"] = usage
            if run.timing is not None and any(c.get("finish_reason") for c in choices):
                body["pdserve_timing"] = run.timing  # pdserve's extension: TTFT by stage
            return f"data: {json.dumps(body)}\n\n"

        async def events() -> AsyncIterator[str]:
            finished = 0
            pending: dict[asyncio.Future[RequestOutput], _Choice] = {}
            try:
                if chat:
                    yield chunk(
                        [
                            {
                                "index": c.index,
                                "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None,
                            }
                            for c in run.choices
                        ]
                    )
                pending.update({asyncio.ensure_future(run.next(c)): c for c in run.choices})
                while pending:
                    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for fut in done:
                        c = pending.pop(fut)
                        out = fut.result()
                        if out.error is not None:
                            err = APIError(out.error, 503, "server_error", code="unavailable")
                            yield f"data: {json.dumps(err.body())}\n\n"
                            yield "data: [DONE]\n\n"
                            return
                        new_ids = out.token_ids[c.sent_tokens :]
                        new_lps = out.logprobs[c.sent_tokens :]
                        c.sent_tokens = len(out.token_ids)
                        if out.delta_text or out.finished:
                            yield chunk(
                                [self._delta(c.index, out, chat, want_logprobs, new_ids, new_lps)]
                            )
                        if out.finished:
                            finished += 1
                        else:
                            pending[asyncio.ensure_future(run.next(c))] = c
                if run.choices and req.include_usage:
                    yield chunk([], run.usage())
                yield "data: [DONE]\n\n"
            finally:
                if finished < len(run.choices):
                    logger.info("stream %s ended early (client gone?); aborting", rid)
                    for fut in pending:
                        fut.cancel()
                    await run.abort()

        return StreamingResponse(events(), media_type="text/event-stream")

    def _delta(
        self,
        index: int,
        out: RequestOutput,
        chat: bool,
        logprobs: bool,
        ids: list[int],
        lps: list[float],
    ) -> dict[str, Any]:
        finish = out.finish_reason if out.finished else None
        if chat:
            return {
                "index": index,
                "delta": {"content": out.delta_text} if out.delta_text else {},
                "logprobs": self._chat_logprobs(ids, lps) if logprobs else None,
                "finish_reason": finish,
            }
        lp = self._completion_logprobs(ids, lps) if logprobs else None
        return {"index": index, "text": out.delta_text, "logprobs": lp, "finish_reason": finish}


def build_app(backend: ServingBackend) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    api = App(backend)
    app.state.pdserve = api

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(APIError(message, param=".".join(loc) or None).body(), status_code=400)

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

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "pdserve"}
            ],
        }

    @app.get("/health")
    async def health() -> Response:
        ok, why = backend.health()
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "detail": why}, 200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(api.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
