"""`pdserve router`: one OpenAI-compatible front for several decode entrances and prefill nodes.

Per request the router picks a decode entrance and a prefill node with its policy
(`policy.py`), forwards the body unchanged to that decode with the prefill choice in the
`x-pdserve-prefill` header (or "local": prefill on decode, counted by reason), and streams the
answer back as it comes. Decode validates the request, tokenizes, and checks that the named
prefill node is one of its own; if that node is down it uses another of its prefill nodes.

Front door: with `--api-key` a request without the key is refused 401 before a byte of its
body is read, and bodies beyond `--max-body-bytes` get 413 (the nodes' own `Guard`); parsing
and tokenizing a prompt for the prefix index run on a small thread pool, never on the event
loop, and index only a bounded prefix (`prompts.py`). A request leaves a trace in the
router's state (prefix index, recent work, counters) only once a decode accepted it.

Health and load: every `poll_s` the router reads each decode's /health and /metrics (waiting
and running requests) over its own small connection pool, so a forwarding pool full of
streams never delays a probe; a decode that fails either, or that refuses a connection, stops
receiving requests until it answers again, and its prefix index is forgotten (a restart lost
its cache). A request whose decode fails before answering (no byte sent to the client yet;
for a non-streaming request, before its whole answer arrived) is retried once on another
decode; a stream cut mid-way ends with an error event. Every upstream wait ends by the
request's deadline (`--request-timeout`: 504), and a client that goes away (streaming or not)
closes its upstream connection, which aborts the request on the decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.api.access import AccessLog
from pdserve.api.guard import Guard
from pdserve.api.protocol import PREFILL_HEADER, APIError
from pdserve.api.routes import client_gone
from pdserve.config import RouterConfig
from pdserve.disagg.wire import CLIENT_CLOSED
from pdserve.engine.sequence import LOCAL_PREFILL as LOCAL
from pdserve.router.policy import Node, NoHealthyNode, Policy
from pdserve.router.prompts import KVView, PromptIndex

logger = logging.getLogger(__name__)

FORWARDED_HEADERS = ("authorization", "content-type")
LOAD_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running")  # vLLM reads alike
OPEN_PATHS = ("/health", "/metrics")  # served without the router's API key
INDEX_THREADS = 2  # requests parsed and tokenized for the index at once
POOL_WAIT_S = 30.0  # a request waits this long for a forwarding connection, then 503
PROBE_CONNECTIONS_PER_DECODE = 2


class _ClientGone(Exception):
    pass


class _PastDeadline(Exception):
    pass


def error_body(message: str, kind: str = "server_error") -> dict[str, Any]:
    return APIError(message, kind=kind).body()


class Router:
    def __init__(self, config: RouterConfig) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health poll
        if not config.decodes:
            raise ValueError("the router needs at least one --decode URL")
        self.config = config
        self.decodes = [Node(u.rstrip("/")) for u in config.decodes]
        self.prefills = [Node(a) for a in config.prefills]
        self.prompts = PromptIndex(config)
        self.kv_views = {n.name: KVView() for n in self.decodes}
        observed = (
            (lambda chain, name: self.kv_views[name].matched(chain))
            if self.prompts.tokenizer is not None
            else None
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
        verify: ssl.SSLContext | bool = True
        if config.tls.ca:
            verify = ssl.create_default_context(cafile=config.tls.ca)
        # Requests (streams held for their whole length) and probes never share a pool: a
        # pool full of streams must not make a probe wait, time out and mark a decode dead.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=config.connect_timeout_s, pool=POOL_WAIT_S),
            limits=httpx.Limits(
                max_connections=config.max_connections,
                max_keepalive_connections=min(config.max_connections, 100),
            ),
            verify=verify,
        )
        self.probes = httpx.AsyncClient(
            timeout=config.probe_timeout_s,
            limits=httpx.Limits(max_connections=PROBE_CONNECTIONS_PER_DECODE * len(self.decodes)),
            verify=verify,
        )
        self._indexer = ThreadPoolExecutor(INDEX_THREADS, thread_name_prefix="router-index")
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
        await self.probes.aclose()
        self._indexer.shutdown(wait=False, cancel_futures=True)

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_s)
            await self.poll_once()

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._probe(n) for n in self.decodes))

    async def _probe(self, node: Node) -> None:
        timeout = self.config.probe_timeout_s
        try:
            health = await self.probes.get(f"{node.name}/health", timeout=timeout)
            metrics = await self.probes.get(
                f"{node.name}/metrics", headers=self._own_headers, timeout=timeout
            )
            ok = health.status_code == 200 and metrics.status_code == 200
            reported = self._reported_load(metrics.text) if ok else 0
            if ok and self.prompts.tokenizer is not None:
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
        r = await self.probes.get(
            f"{node.name}/kv_events",
            params=params,
            headers=self._own_headers,
            timeout=self.config.probe_timeout_s,
        )
        if r.status_code == 200:
            view.apply(r.json())
            self.kv_blocks.labels(node.name).set(len(view.keys))

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

    def _choose_prefill(
        self, chain: list[bytes], text: str, decode: Node
    ) -> tuple[Node | None, str | None]:
        """The prefill node for a request, or None and the reason to prefill on decode."""
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
            return None, reason
        return self.prefill_policy.choose(self.prefills, chain), None

    def _upstream_headers(self, request: Request) -> dict[str, str]:
        """What goes on to the decode: the body's type, and the client's own Authorization
        (or, when the router checked its own key, the decodes' key instead)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        if self.config.api_key is not None:
            headers.pop("authorization", None)
            headers.update(self._own_headers)
        return headers

    async def route(self, request: Request, path: str) -> Response:
        deadline = time.monotonic() + self.config.request_timeout_s
        raw = await request.body()  # bounded by the Guard (--max-body-bytes)
        try:
            loop = asyncio.get_running_loop()
            body, text, chain = await loop.run_in_executor(self._indexer, self.prompts.prepare, raw)
        except ValueError as e:
            return JSONResponse(error_body(str(e), "invalid_request_error"), 400)
        headers = self._upstream_headers(request)
        tried: tuple[str, ...] = ()
        for attempt in range(2):
            try:
                decode = self.decode_policy.choose(self.decodes, chain, tried)
            except NoHealthyNode:
                break
            prefill, reason = self._choose_prefill(chain, text, decode)
            headers[PREFILL_HEADER] = prefill.name if prefill is not None else LOCAL
            response = await self._forward(
                Upstream(decode, prefill, path, raw, headers, bool(body.get("stream"))),
                request,
                deadline,
            )
            if response is not None:
                if response.status_code < 400:  # accepted: now it counts
                    self._account(chain, decode, prefill, reason)
                return response
            tried += (decode.name,)
            if attempt == 0:
                self.retries.inc()
        names = ", ".join(tried) or "none healthy"
        return JSONResponse(
            error_body(f"no decode entrance could serve the request ({names})"), 503
        )

    def _account(
        self, chain: list[bytes], decode: Node, prefill: Node | None, reason: str | None
    ) -> None:
        self.decode_policy.record(chain, decode)
        if prefill is not None:
            self.prefill_policy.record(chain, prefill)
        elif reason is not None:
            self.local.labels(reason).inc()
        self.routed.labels(decode.name, prefill.name if prefill is not None else LOCAL).inc()

    async def _forward(self, up: Upstream, client: Request, deadline: float) -> Response | None:
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
                return Response(content, upstream.status_code, self._answer_headers(upstream))
        except httpx.PoolTimeout:  # the router's own limit (--max-connections), not the decode
            release_all()
            message = "the router is at its connection limit (--max-connections)"
            return JSONResponse(error_body(message), 503, {"retry-after": "1"})
        except httpx.HTTPError as e:
            release_all()
            logger.warning("decode %s failed before answering: %s", up.decode.name, e)
            self._set_health(up.decode, False)
            return None
        except _ClientGone:  # its upstream connection is closed: the decode aborts it
            release_all()
            return Response(status_code=CLIENT_CLOSED)
        except _PastDeadline:
            release_all()
            message = f"the request passed its deadline ({self.config.request_timeout_s} s)"
            return JSONResponse(error_body(message, "timeout"), 504)
        prefill = up.prefill
        first_byte = (lambda: release(prefill)) if prefill is not None else (lambda: None)
        return StreamingResponse(
            self._relay(upstream, up.decode, first_byte, release_all, deadline),
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
            message = f"the request passed its deadline ({self.config.request_timeout_s} s)"
            yield f"data: {json.dumps(error_body(message, 'timeout'))}\n\n".encode()
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
        headers = self._upstream_headers(request)
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
        cfg = self.config
        app.add_middleware(
            Guard, api_key=cfg.api_key, open_paths=OPEN_PATHS, max_body_bytes=cfg.max_body_bytes
        )
        app.add_middleware(AccessLog)  # outermost: sees refusals too

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
