"""`pdserve router`: one OpenAI-compatible front for several decode entrances and prefill nodes.

Per request the router picks a decode entrance and a prefill node with its policy
(`policy.py`), forwards the body unchanged to that decode with the prefill choice in the
`x-pdserve-prefill` header (or "local": prefill on decode, counted by reason), and streams the
answer back as it comes. Decode validates the request, tokenizes, and checks that the named
prefill node is one of its own; if that node is down it uses another of its prefill nodes.

Health and load: every `poll_s` the router reads each decode's /health and /metrics (waiting
and running requests); a decode that fails either, or that refuses a connection, stops
receiving requests until it answers again, and its prefix index is forgotten (a restart lost
its cache). A request whose decode fails before answering (no byte sent to the client yet;
for a non-streaming request, before its whole answer arrived) is retried once on another
decode; a stream cut mid-way ends with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.api.protocol import PREFILL_HEADER, APIError
from pdserve.config import RouterConfig
from pdserve.engine.block_pool import cache_keys
from pdserve.engine.sequence import LOCAL_PREFILL as LOCAL
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.policy import Node, NoHealthyNode, Policy, prefix_chain

logger = logging.getLogger(__name__)

FORWARDED_HEADERS = ("authorization", "content-type")
LOAD_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running")  # vLLM reads alike


@dataclass
class KVView:
    """What one decode reported holding in its prefix cache (its KV events, followed)."""

    epoch: str | None = None
    seq: int = 0
    keys: set[bytes] = field(default_factory=set)

    def apply(self, changes: dict[str, Any]) -> None:
        def as_keys(hexes: list[str]) -> list[bytes]:
            return [int(h, 16).to_bytes(8, "little") for h in hexes]

        if changes["reset"]:
            self.keys = set(as_keys(changes["stored"]))
        else:
            self.keys.update(as_keys(changes["stored"]))
            self.keys.difference_update(as_keys(changes["removed"]))
        self.epoch, self.seq = str(changes["epoch"]), int(changes["seq"])

    def matched(self, chain: list[bytes]) -> int:
        n = 0
        for key in chain:
            if key not in self.keys:
                break
            n += 1
        return n


def error_body(message: str, kind: str = "server_error") -> dict[str, Any]:
    return APIError(message, kind=kind).body()


def prefix_text(body: dict[str, Any]) -> str:
    """The request's prompt as one string, for the prefix index: a completion's prompt, or a
    chat's messages with their roles."""
    if "messages" in body and isinstance(body["messages"], list):
        parts = []
        for m in body["messages"]:
            if isinstance(m, dict):
                content = m.get("content")
                text = content if isinstance(content, str) else json.dumps(content)
                parts.append(f"{m.get('role')}\x1f{text}\x1e")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt))
    return ""


class Router:
    def __init__(self, config: RouterConfig) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health poll
        if not config.decodes:
            raise ValueError("the router needs at least one --decode URL")
        self.config = config
        self.decodes = [Node(u.rstrip("/")) for u in config.decodes]
        self.prefills = [Node(a) for a in config.prefills]
        # With the nodes' tokenizer, chains are the engine's block keys and decodes' KV events
        # say what each holds; without it, chains are text chunks and only routing is known.
        self.tokenizer = Tokenizer(config.tokenizer) if config.tokenizer else None
        self.kv_views = {n.name: KVView() for n in self.decodes}
        observed = (
            (lambda chain, name: self.kv_views[name].matched(chain)) if self.tokenizer else None
        )
        self.decode_policy = Policy(config.policy, observed=observed)
        self.prefill_policy = Policy(config.policy)
        self.registry = CollectorRegistry()
        self.routed = Counter(
            "pdserve:router_requests",
            "Requests routed, by decode entrance and prefill node ('local': on decode)",
            ["decode", "prefill"],
            registry=self.registry,
        )
        self.local = Counter(
            "pdserve:router_local_prefill",
            "Requests the router sent to prefill on decode, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.retries = Counter(
            "pdserve:router_retries", "Requests retried on another decode", registry=self.registry
        )
        self.kv_blocks = Gauge(
            "pdserve:router_kv_blocks",
            "Prefix-cache blocks each decode reported holding (its KV events, followed)",
            ["decode"],
            registry=self.registry,
        )
        self.healthy = Gauge(
            "pdserve:router_node_healthy", "1 if the router sends requests to the node",
            ["node"], registry=self.registry,
        )  # fmt: skip
        timeout = httpx.Timeout(None, connect=config.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout)
        # Only on the router's own calls: a client's request goes on with the client's own
        # Authorization (or none), never with the router's key.
        key = config.node_api_key
        self._own_headers = {"authorization": "Bearer " + key.value.decode()} if key else {}
        self._poll: asyncio.Task[None] | None = None
        self.app = self._build_app()

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await self.poll_once()
        self._poll = asyncio.create_task(self._poll_loop())

    async def stop(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll
        await self.client.aclose()

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_s)
            await self.poll_once()

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._probe(n) for n in self.decodes))

    async def _probe(self, node: Node) -> None:
        timeout = self.config.probe_timeout_s
        try:
            health = await self.client.get(f"{node.name}/health", timeout=timeout)
            metrics = await self.client.get(
                f"{node.name}/metrics", headers=self._own_headers, timeout=timeout
            )
            ok = health.status_code == 200 and metrics.status_code == 200
            reported = self._reported_load(metrics.text) if ok else 0
            if ok and self.tokenizer is not None:
                await self._follow_kv(node)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            logger.debug("decode %s probe failed: %s", node.name, e)
            ok, reported = False, 0
        self._set_health(node, ok)
        node.reported = reported

    async def _follow_kv(self, node: Node) -> None:
        """Apply the decode's prefix-cache changes since the last poll (all of it after a
        restart: a new epoch resets the view)."""
        view = self.kv_views[node.name]
        params: dict[str, Any] = {"since": view.seq}
        if view.epoch is not None:
            params["epoch"] = view.epoch
        r = await self.client.get(
            f"{node.name}/kv_events",
            params=params,
            headers=self._own_headers,
            timeout=self.config.probe_timeout_s,
        )
        if r.status_code == 200:
            view.apply(r.json())
            self.kv_blocks.labels(node.name).set(len(view.keys))

    def chain_of(self, body: dict[str, Any], text: str) -> list[bytes]:
        """The request's chain: its prompt's block keys as the engine computes them (when the
        nodes' tokenizer is known and the prompt tokenizes), else its text chunks."""
        tok = self.tokenizer
        if tok is not None:
            with contextlib.suppress(Exception):  # a bad body: decode will say what is wrong
                prompt, messages = body.get("prompt"), body.get("messages")
                if isinstance(messages, list):
                    ids = tok.apply_chat_template(messages)
                elif isinstance(prompt, str):
                    ids = tok.encode(prompt)
                elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                    ids = prompt
                else:
                    ids = []
                if ids:
                    keys = cache_keys(ids, self.config.block_size)
                    return [k.to_bytes(8, "little") for k in keys]
        return prefix_chain(text)

    @staticmethod
    def _reported_load(text: str) -> int:
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in LOAD_GAUGES:
                    total += sample.value
        return int(total)

    def _set_health(self, node: Node, ok: bool) -> None:
        if ok != node.healthy:
            logger.warning("decode %s is %s", node.name, "back" if ok else "unavailable")
            if ok:  # it restarted, or came back: what it cached may be gone
                self.decode_policy.index.forget(node.name)
        node.healthy = ok
        self.healthy.labels(node.name).set(1 if ok else 0)

    # ---- routing --------------------------------------------------------------------------

    def _choose_prefill(self, chain: list[bytes], text: str, decode: Node) -> Node | None:
        """The prefill node for a request, or None: prefill on decode (counted by reason)."""
        cfg = self.config
        reason = None
        if not self.prefills:
            reason = "no_prefill_nodes"
        elif len(text) < cfg.local_prefill_below:
            reason = "short_prompt"
        elif (
            cfg.prefill_queue_limit > 0
            and min(p.load for p in self.prefills) >= cfg.prefill_queue_limit
            and decode.load == 0
        ):
            reason = "prefill_busy"
        if reason is not None:
            self.local.labels(reason).inc()
            return None
        return self.prefill_policy.pick(self.prefills, chain)

    async def route(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return JSONResponse(error_body("body: not JSON", "invalid_request_error"), 400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("body: not an object", "invalid_request_error"), 400)
        text = prefix_text(body)
        chain = self.chain_of(body, text)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        tried: tuple[str, ...] = ()
        for attempt in range(2):
            try:
                decode = self.decode_policy.pick(self.decodes, chain, tried)
            except NoHealthyNode:
                break
            prefill = self._choose_prefill(chain, text, decode)
            headers[PREFILL_HEADER] = prefill.name if prefill is not None else LOCAL
            self.routed.labels(decode.name, headers[PREFILL_HEADER]).inc()
            response = await self._forward(decode, prefill, path, raw, headers, body)
            if response is not None:
                return response
            tried += (decode.name,)
            if attempt == 0:
                self.retries.inc()
        names = ", ".join(tried) or "none healthy"
        return JSONResponse(
            error_body(f"no decode entrance could serve the request ({names})"), 503
        )

    async def _forward(
        self,
        decode: Node,
        prefill: Node | None,
        path: str,
        raw: bytes,
        headers: dict[str, str],
        body: dict[str, Any],
    ) -> Response | None:
        """The decode's answer, or None when it failed before any byte reached the client."""
        held = [n for n in (decode, prefill) if n is not None]
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
            "POST", decode.name + path, content=raw, headers=headers
        )
        try:
            upstream = await self.client.send(request, stream=True)
            if not body.get("stream"):
                content = await upstream.aread()  # whole, so a failure here can be retried
                await upstream.aclose()
                release_all()
                return Response(content, upstream.status_code, self._answer_headers(upstream))
        except httpx.HTTPError as e:
            release_all()
            logger.warning("decode %s failed before answering: %s", decode.name, e)
            self._set_health(decode, False)
            return None
        first_byte = (lambda: release(prefill)) if prefill is not None else (lambda: None)
        return StreamingResponse(
            self._relay(upstream, decode, first_byte, release_all),
            upstream.status_code,
            self._answer_headers(upstream),
        )

    @staticmethod
    def _answer_headers(upstream: httpx.Response) -> dict[str, str]:
        keep = ("content-type", "retry-after")
        return {k: v for k, v in upstream.headers.items() if k.lower() in keep}

    async def _relay(
        self,
        upstream: httpx.Response,
        decode: Node,
        first_byte: Callable[[], None],
        done: Callable[[], None],
    ) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                first_byte()
                yield chunk
        except httpx.HTTPError as e:
            logger.warning("decode %s failed mid-stream: %s", decode.name, e)
            self._set_health(decode, False)
            message = f"the decode entrance failed mid-stream: {type(e).__name__}"
            yield f"data: {json.dumps(error_body(message))}\n\n".encode()
        finally:
            done()
            await upstream.aclose()

    async def _any_decode(self, request: Request, path: str) -> Response:
        """A request any decode answers alike (they serve one model): the first healthy one's
        answer."""
        body = await request.body()
        keep = ("authorization", "content-type")
        headers = {k: v for k, v in request.headers.items() if k.lower() in keep}
        for node in self.decodes:
            if not node.healthy:
                continue
            with contextlib.suppress(httpx.HTTPError):
                r = await self.client.request(
                    request.method, node.name + path, content=body, headers=headers, timeout=5
                )
                return Response(r.content, r.status_code, self._answer_headers(r))
        return JSONResponse(error_body("no decode entrance is healthy"), 503)

    # ---- the app --------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.route(request, "/v1/completions")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self.route(request, "/v1/chat/completions")

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            return await self._any_decode(request, "/v1/models")

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Response:
            return await self._any_decode(request, "/tokenize")

        @app.post("/detokenize")
        async def detokenize(request: Request) -> Response:
            return await self._any_decode(request, "/detokenize")

        @app.get("/health")
        async def health() -> Response:
            up = [n.name for n in self.decodes if n.healthy]
            body = {"status": "ok" if up else "unavailable", "decodes": up, "at": time.time()}
            return JSONResponse(body, 200 if up else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

        return app
