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

Health and load: `health.py` probes every decode and prefill node; one that fails a probe
stops receiving requests until it answers again, and its prefix index is forgotten (a restart
lost its cache); with no prefill node up, decode prefills (`prefill_unavailable`). A request
whose decode fails before answering (no byte sent to the client yet; for a non-streaming
request, before its whole answer arrived) is retried once on another decode. A stream of one
choice whose decode fails mid-way goes on from another decode where it stopped (`resume.py`:
the decode computes prompt + tokens so far and sends only what follows); any other stream cut
mid-way ends with an error event. Every upstream wait ends by the request's deadline
(`--request-timeout`: 504), and a client that goes away (streaming or not) closes its upstream
connection, which aborts the request on the decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve import tracing
from pdserve.api.access import AccessLog
from pdserve.api.guard import Guard
from pdserve.api.protocol import PREFILL_HEADER, REQUEST_ID_HEADER
from pdserve.api.traces import TracedRequests, request_span
from pdserve.config import DEFAULT_DRAIN_TIMEOUT_S, RouterConfig
from pdserve.engine.sequence import LOCAL_PREFILL as LOCAL
from pdserve.router.audit import RoutingAudit
from pdserve.router.forward import Forwarder, Upstream, answer_headers, error_body
from pdserve.router.health import NodeAccess, NodeMonitor
from pdserve.router.policy import Node, NoHealthyNode, Policy
from pdserve.router.prompts import KVView, PromptIndex
from pdserve.router.resume import StreamFollower, asking_ids, resumable
from pdserve.tracing import TRACEPARENT

logger = logging.getLogger(__name__)

# A client's traceparent goes on as it came unless the router traces (then: its own span's).
FORWARDED_HEADERS = ("authorization", "content-type", TRACEPARENT)
OPEN_PATHS = ("/health", "/metrics")  # served without the router's API key
INDEX_THREADS = 2  # requests parsed and tokenized for the index at once
POOL_WAIT_S = 30.0  # a request waits this long for a forwarding connection, then 503
DRAIN_POLL_S = 0.05  # how often a drain looks whether the decode's requests are done
TELL_TIMEOUT_S = 10.0  # a decode told that a prefill node moved answers within this


class DrainRequest(BaseModel):
    """`POST /admin/drain` (behind the router's --api-key): take `decode` out of rotation and
    move its streams away, waiting at most `timeout_s` for the rest; `undo`: put it back."""

    model_config = ConfigDict(extra="forbid")
    decode: str
    timeout_s: float = Field(default=DEFAULT_DRAIN_TIMEOUT_S, ge=0, le=3600)
    undo: bool = False
    migrate: bool = True  # streams move live where the decode can pause them (else recompute)


class Router:
    def __init__(self, config: RouterConfig) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health poll
        if not config.decodes:
            raise ValueError("the router needs at least one --decode URL")
        self.config = config
        self.decodes = [Node(u.rstrip("/")) for u in config.decodes]
        self.prefills = [Node(a) for a in config.prefills]
        # Each prefill node's address now -> the one decodes were started with (`readdress`).
        self._first_address: dict[str, str] = {}
        self.prompts = PromptIndex(config)
        self.kv_views = {n.name: KVView() for n in (*self.decodes, *self.prefills)}
        observed = (
            (lambda chain, name: self.kv_views[name].matched(chain))
            if self.prompts.tokenizer is not None
            else None
        )
        self.decode_policy = Policy(config.policy, observed=observed)
        self.prefill_policy = Policy(config.policy, observed=observed)
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
        self.last_resort = Counter(
            "pdserve:router_last_resort",
            "Requests sent to a decode the probes marked unavailable, as none was healthy",
            registry=self.registry,
        )
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
        self._indexer = ThreadPoolExecutor(INDEX_THREADS, thread_name_prefix="router-index")
        key = config.node_api_key
        self._own_headers = {"authorization": "Bearer " + key.value.decode()} if key else {}
        self.monitor = NodeMonitor(
            config, self.decodes, self.kv_views if self.prompts.tokenizer is not None else None,
            NodeAccess(self._own_headers, verify), self.registry, on_back=self._back,
            prefills=self.prefills, on_gone=self._gone,
        )  # fmt: skip
        self.audit = RoutingAudit(self.registry)
        self.forward = Forwarder(
            self.client,
            config.request_timeout_s,
            self.monitor.set_health,
            self.registry,
            resume_on=self._resume_on,
        )
        # Set by `pdserve cluster`, which can restart its nodes: every node, one at a time.
        self.rolling_restart: Callable[[], Awaitable[dict[str, Any]]] | None = None
        self.app = self._build_app()

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await self.monitor.start()

    async def stop(self) -> None:
        await self.monitor.stop()
        self.forward.stop()
        await self.client.aclose()
        self._indexer.shutdown(wait=False, cancel_futures=True)

    def _forget(self, node: Node) -> None:
        """`node` came back after failing: what it had cached may be gone."""
        for policy in (self.decode_policy, self.prefill_policy):
            policy.index.forget(node.name)

    def _gone(self, name: str, keys: set[bytes]) -> None:
        """`name`'s KV events say it evicted these blocks: the prefix index's record of what
        the router sent there forgets them too, so it predicts only what the node holds."""
        if keys:
            self.decode_policy.index.forget_keys(keys, name)
            self.prefill_policy.index.forget_keys(keys, name)

    def _back(self, node: Node) -> None:
        """`node` answers again after failing (it may have restarted)."""
        self._forget(node)
        if any(n is node for n in self.decodes):
            self._retell(node)

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
        try:
            return self.prefill_policy.choose(self.prefills, chain), None
        except NoHealthyNode:  # every prefill node down (or draining): decode computes it
            return None, "prefill_unavailable"

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
            body, text, chain, keyed = await loop.run_in_executor(
                self._indexer, self.prompts.prepare, raw
            )
        except ValueError as e:
            return JSONResponse(error_body(str(e), "invalid_request_error"), 400)
        headers = self._upstream_headers(request)
        stream, follow = bool(body.get("stream")), resumable(body)
        if follow:  # each delta's token ids, for a resume
            raw = json.dumps(asking_ids(body)).encode()
        tried: tuple[str, ...] = ()
        for attempt in range(2):
            try:
                decode = self.decode_policy.choose(self.decodes, chain, tried, last_resort=True)
            except NoHealthyNode:
                break
            if not decode.healthy:
                self.last_resort.inc()
                logger.info("no decode is healthy to the probes: trying %s", decode.name)
            prefill, reason = self._choose_prefill(chain, text, decode)
            headers[PREFILL_HEADER] = prefill.name if prefill is not None else LOCAL
            held = self.decode_policy.held(chain, decode.name)  # the prefix it predicts
            self._trace_choice(request, headers, chain, decode, held, prefill, reason)
            follower = (
                StreamFollower(
                    path.endswith("/chat/completions"), bool(body.get("return_token_ids"))
                )
                if follow
                else None
            )
            if follower is not None:  # its id on the decode, to name it in a drain
                follower.request_id = headers[REQUEST_ID_HEADER] = uuid.uuid4().hex
            # audited when the chain is the engine's block keys: hits then count in tokens
            audit = self.audit.expect(decode.name, held * self.config.block_size if keyed else 0)
            up = Upstream(decode, prefill, path, raw, dict(headers), stream, body, follower, audit)
            response = await self.forward(up, request, deadline)
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

    def _trace_choice(
        self,
        request: Request,
        headers: dict[str, str],
        chain: list[bytes],
        decode: Node,
        held: int,
        prefill: Node | None,
        local_reason: str | None,
    ) -> None:
        """The route decision on the request's span (the policy, why, the `held` chunks it
        predicts the decode holds, and the prefill's), and the span as the decode's parent."""
        span = request_span(request.state)
        if span.traceparent is None:
            return
        attributes: dict[str, str | int | float | bool] = {
            "pdserve.router.policy": self.decode_policy.name,
            "pdserve.router.decode": decode.name,
            "pdserve.router.reason": "prefix" if held else "load",
            "pdserve.router.chain_chunks": len(chain),
            "pdserve.router.predicted_hit_chunks": held,
            "pdserve.router.prefill": prefill.name if prefill is not None else LOCAL,
        }
        if prefill is not None:
            attributes["pdserve.router.prefill_predicted_hit_chunks"] = self.prefill_policy.held(
                chain, prefill.name
            )
        elif local_reason is not None:
            attributes["pdserve.router.local_reason"] = local_reason
        span.set(attributes)
        headers[TRACEPARENT] = span.traceparent

    def _resume_on(self, tried: tuple[str, ...]) -> Node | None:
        """Where a stream whose decode failed goes on: the least loaded healthy decode it has
        not been on (its prompt is computed there afresh, so the prefix index has no say)."""
        try:
            return self.decode_policy.choose(self.decodes, [], tried, last_resort=True)
        except NoHealthyNode:
            return None

    async def drain(self, name: str, timeout_s: float, migrate: bool = True) -> dict[str, Any]:
        """Take decode `name` out of rotation: no new request goes there, its streams of one
        choice move to other decodes now — live where it pauses them (`migrate`: their KV is
        fetched, not computed again), else by recompute — and the others are waited for until
        `timeout_s` passes. What it did; KeyError for a decode it does not route to."""
        node = self._decode(name)
        node.draining = True
        relays = self.forward.movable(node)
        paused, address = await self._pause(node, list(relays)) if migrate else ([], "")
        for request_id, relay in relays.items():
            if request_id in paused:
                relay.hand_over(address)
            else:
                relay.move()
        moved = len(relays)
        logger.warning(
            "draining decode %s: %d streams moved (%d live)", node.name, moved, len(paused)
        )
        deadline = time.monotonic() + timeout_s
        while node.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        left = node.in_flight
        return {
            "decode": node.name,
            "moved": moved,
            "migrated": len(paused),
            "in_flight": left,
            "drained": left == 0,
        }

    async def _pause(self, decode: Node, request_ids: list[str]) -> tuple[set[str], str]:
        """Ask `decode` to pause these streams for a live migration: the ids it paused and
        where their KV is fetched (none, where it cannot: they move by recompute)."""
        if not request_ids:
            return set(), ""
        try:
            r = await self.client.post(
                f"{decode.name}/admin/migrate",
                json={"request_ids": request_ids},
                headers=self._own_headers,
                timeout=TELL_TIMEOUT_S,
            )
            r.raise_for_status()
            answer = r.json()
            return set(answer["migrated"]), str(answer["address"])
        except (httpx.HTTPError, ValueError, KeyError) as e:
            logger.warning(
                "decode %s paused no streams (%s): they move by recompute", decode.name, e
            )
            return set(), ""

    def undrain(self, name: str) -> dict[str, Any]:
        """Put decode `name` back in rotation (after its restart, say)."""
        node = self._decode(name)
        node.draining = False
        logger.warning("decode %s is back in rotation", node.name)
        return {"decode": node.name, "draining": False}

    async def readdress(self, old: str, new: str) -> None:
        """A node restarted on another address (`pdserve cluster` found it there): routed to
        there from now on, what it cached forgotten; for a prefill node every decode is told
        too (`POST /admin/prefill-address`, with the router's own key), and told again when it
        comes back (a restarted decode starts with the address it was first given). KeyError
        for a node it does not route to."""
        node = next((n for n in (*self.decodes, *self.prefills) if n.name == old), None)
        if node is None:
            raise KeyError(old)
        is_prefill = any(n is node for n in self.prefills)
        self._forget(node)
        self.kv_views.pop(old, None)
        node.name = new if is_prefill else new.rstrip("/")
        self.kv_views[node.name] = KVView()
        self.monitor.forget(old)
        logger.warning("%s %s is at %s now", "prefill" if is_prefill else "decode", old, new)
        if is_prefill:
            self._first_address[node.name] = self._first_address.pop(old, old)
            await asyncio.gather(*(self._tell(d, old, node.name) for d in self.decodes))

    async def _tell(self, decode: Node, old: str, new: str) -> None:
        """Tell `decode` that its prefill node at `old` is at `new` now."""
        try:
            r = await self.client.post(
                f"{decode.name}/admin/prefill-address",
                json={"old": old, "new": new},
                headers=self._own_headers,
                timeout=TELL_TIMEOUT_S,
            )
            if r.status_code not in (200, 404):  # 404: it knows no `old` (told already)
                logger.warning("decode %s kept %s: %s", decode.name, old, r.text[:300])
        except httpx.HTTPError as e:  # down: told again when it comes back
            logger.warning("decode %s not told that %s moved: %s", decode.name, old, e)

    def _retell(self, decode: Node) -> None:
        """A decode back (perhaps restarted with the prefill addresses it was first given):
        told again where every moved prefill node is now."""
        for new, first in self._first_address.items():
            if first != new:
                asyncio.ensure_future(self._tell(decode, first, new))

    def _decode(self, name: str) -> Node:
        for node in self.decodes:
            if node.name == name.rstrip("/"):
                return node
        raise KeyError(name)

    def _account(
        self, chain: list[bytes], decode: Node, prefill: Node | None, reason: str | None
    ) -> None:
        self.decode_policy.record(chain, decode)
        if prefill is not None:
            self.prefill_policy.record(chain, prefill)
        elif reason is not None:
            self.local.labels(reason).inc()
        self.routed.labels(decode.name, prefill.name if prefill is not None else LOCAL).inc()

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
                return Response(r.content, r.status_code, answer_headers(r))
        return JSONResponse(error_body("no decode entrance is healthy"), 503)

    # ---- the app --------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None)
        cfg = self.config
        app.add_middleware(
            Guard, api_key=cfg.api_key, open_paths=OPEN_PATHS, max_body_bytes=cfg.max_body_bytes
        )
        app.add_middleware(AccessLog)  # outermost: sees refusals too
        if tracing.enabled():
            app.add_middleware(TracedRequests, name="pdserve.router.request")

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
            up = [n.name for n in self.decodes if n.healthy and not n.draining]
            body = {
                "status": "ok" if up else "unavailable",
                "decodes": up,
                "draining": [n.name for n in self.decodes if n.draining],
                "prefills": [n.name for n in self.prefills if n.healthy and not n.draining],
                "at": time.time(),
            }
            return JSONResponse(body, 200 if up else 503)

        @app.post("/admin/rolling-restart")
        async def rolling_restart() -> Response:
            if self.rolling_restart is None:
                message = "a rolling restart needs `pdserve cluster` (it restarts the nodes)"
                return JSONResponse(error_body(message, "invalid_request_error"), 404)
            return JSONResponse(await self.rolling_restart())

        @app.post("/admin/drain")
        async def drain(request: Request) -> Response:
            try:
                asked = DrainRequest.model_validate_json(await request.body())
                if asked.undo:
                    return JSONResponse(self.undrain(asked.decode))
                return JSONResponse(await self.drain(asked.decode, asked.timeout_s, asked.migrate))
            except ValidationError as e:
                return JSONResponse(error_body(str(e), "invalid_request_error"), 400)
            except KeyError:
                message = f"{asked.decode!r} is not a decode of this router"
                return JSONResponse(error_body(message, "invalid_request_error"), 404)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

        return app
