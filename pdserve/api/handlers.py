"""The generation and tokenizer endpoints behind the HTTP app's routes (`routes.py`): each
completion or chat request checked, tokenized off the event loop, and run as a `Run` on the
node, answered whole or streamed as server-sent events."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.api.metrics import ServingMetrics
from pdserve.api.node import ServingNode
from pdserve.api.protocol import (
    MAX_REQUEST_ID_CHARS,
    PREFILL_HEADER,
    REQUEST_ID_HEADER,
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
from pdserve.api.sse import client_gone, stream_events
from pdserve.api.traces import request_span
from pdserve.config import DEFAULT_MAX_TOKENS
from pdserve.engine.failure import CLIENT_CLOSED
from pdserve.engine.sequence import (
    LOCAL_PREFILL,
    Migration,
    Resume,
    SamplingError,
    SamplingParams,
)
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
        peer = self._prefill_choice(node, http)
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
        resume = self._resume(req, candidates, self._from_router(http))
        request_id = self._router_id(http) if candidates == 1 else None
        trace = request_span(http.state).traceparent
        options = RunOptions(
            candidates, peer, req.cache_salt, request_id, resume=resume, trace=trace
        )
        run = Run(node, self.metrics, prompt_ids, params, options)
        http.state.run = run  # for the access log
        await run.start()  # the prompt was checked: its ids can be decoded
        echo = ""
        if isinstance(req, CompletionRequest) and req.echo:
            echo = prompt_text if prompt_text is not None else node.tokenizer.decode(prompt_ids)
        render = Renderer(
            node.tokenizer, self.model_name, chat, echo, req.return_token_ids, resume is not None
        )
        if req.stream:
            events = stream_events(
                run, render, req.wants_logprobs, req.include_usage, req.continuous_usage
            )
            return StreamingResponse(events, media_type="text/event-stream")
        return await self._whole(req, run, render, candidates, http)

    def _from_router(self, http: Request) -> bool:
        """Whether the request may carry a router's choices: sent with the router key, or any
        request where no router key is set."""
        return not self.router_only or getattr(http.state, "router", False)

    def _router_id(self, http: Request) -> str | None:
        """The id a router gave the stream (its header), for it to name when it moves it."""
        given = http.headers.get(REQUEST_ID_HEADER)
        if given is None or not self._from_router(http):
            return None
        if not 0 < len(given) <= MAX_REQUEST_ID_CHARS or not given.isascii() or not given.isalnum():
            raise APIError(f"{REQUEST_ID_HEADER}: 1-{MAX_REQUEST_ID_CHARS} letters or digits")
        return given

    @staticmethod
    def _resume(req: SamplingFields, candidates: int, router: bool) -> Resume | None:
        """The stream another node began that this request continues, if any (one choice);
        where the node that paused it holds its KV (a router's migration), fetched from there."""
        asked = req.pdserve_resume
        if asked is None:
            return None
        if candidates > 1:
            raise APIError("a resumed stream has one choice (n and best_of 1)", param="n")
        source = None
        if asked.migrate_from is not None:
            if not router:
                raise APIError("migrate_from is the router's: send the router key", 403)
            source = Migration(asked.migrate_from.address, asked.migrate_from.handle)
        return Resume(tuple(asked.token_ids), asked.sent_chars, source)

    def _prefill_choice(self, node: ServingNode, http: Request) -> str | None:
        """The prefill node a router chose for this request (its header), if it may choose."""
        peer = http.headers.get(PREFILL_HEADER)
        if not self._from_router(http):
            return None  # the prefill choice is the router's (its key) to make: ignored
        if peer is not None and peer != LOCAL_PREFILL and not node.knows_prefill(peer):
            raise APIError(f"{PREFILL_HEADER}: {peer!r} is not a prefill node of this decode")
        return peer

    async def _whole(
        self, req: SamplingFields, run: Run, render: Renderer, candidates: int, http: Request
    ) -> Response:
        """The answer in one body, once every choice finished (best_of: the best n); nothing
        if the client went away meanwhile (its choices aborted)."""
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
