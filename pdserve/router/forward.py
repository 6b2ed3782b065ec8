"""The router's forwarding of one request to a decode: the request's body as it came, the
answer streamed back as it comes, every wait bounded by the request's deadline (504, or an
error event once streaming), and a client that goes away closes the upstream connection, which
aborts the request on the decode. A decode that fails before any byte reached the client is
reported (None), so that the router retries another. When one fails mid-stream (its
connection breaks, or the health probes find it dead while it sends nothing), a stream of one
choice goes on from another decode where it stopped
(`resume.py`); any other ends with an error event."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter

from pdserve.api.protocol import PREFILL_HEADER, REQUEST_ID_HEADER, APIError
from pdserve.api.sse import DONE as DONE_EVENT
from pdserve.api.sse import client_gone
from pdserve.engine.failure import CLIENT_CLOSED
from pdserve.engine.sequence import LOCAL_PREFILL
from pdserve.router.policy import Node
from pdserve.router.resume import MAX_RESUMES, StreamFollower

logger = logging.getLogger(__name__)

DONE = DONE_EVENT.encode()
SILENT_CHECK_S = 0.25  # how often a stream looks whether its silent decode was found dead


def error_body(message: str, kind: str = "server_error") -> dict[str, Any]:
    return APIError(message, kind=kind).body()


def answer_headers(upstream: httpx.Response) -> dict[str, str]:
    """The decode's headers the client sees."""
    keep = ("content-type", "retry-after")
    return {k: v for k, v in upstream.headers.items() if k.lower() in keep}


class _ClientGone(Exception):
    pass


class _PastDeadline(Exception):
    pass


class Forwarder:
    """Sends an `Upstream` attempt through `client` (the router's forwarding pool); a decode
    that fails is told to `set_health(node, False)`. While a request is in flight its decode's
    and prefill's `in_flight` count it (the prefill's until the first byte of the answer).
    `resume_on(tried)` names the decode a broken stream moves to (None: none is left)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        timeout_s: float,
        set_health: Callable[[Node, bool], None],
        registry: CollectorRegistry,
        resume_on: Callable[[tuple[str, ...]], Node | None] = lambda tried: None,
    ) -> None:
        self.client = client
        self.timeout_s = timeout_s  # --request-timeout, named in the 504
        self.set_health = set_health
        self.resume_on = resume_on
        self.resumed = Counter(
            "pdserve:router_resumed_streams",
            "Streams whose decode failed mid-way that went on from another decode",
            registry=registry,
        )
        self.relays: set[_Relay] = set()  # streams being relayed now
        self._watch: asyncio.Future[None] | None = None  # `_watch_silence`, while any
        self.migrated = Counter(
            "pdserve:router_migrated_streams",
            "Streams a drained decode paused that went on from another decode with their KV",
            registry=registry,
        )
        self.resume_failed = Counter(
            "pdserve:router_resume_failed",
            "Streams whose decode failed mid-way that no other decode could go on with",
            registry=registry,
        )

    async def send(self, up: Upstream, client: Request | None, deadline: float) -> httpx.Response:
        """The decode's answer to `up`, its body still to read (bounded by `deadline`, and by
        `client` going away where given)."""
        request = self.client.build_request(
            "POST", up.decode.name + up.path, content=up.raw, headers=up.headers
        )
        response: httpx.Response = await _bounded(
            self.client.send(request, stream=True), client, deadline
        )
        return response

    async def __call__(self, up: Upstream, client: Request, deadline: float) -> Response | None:
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

        try:
            upstream = await self.send(up, client, deadline)
            if not up.stream:
                try:  # whole, so a failure here can be retried
                    content = await _bounded(upstream.aread(), client, deadline)
                finally:
                    await upstream.aclose()
                release_all()
                if upstream.status_code == 200:
                    up.on_answer(content)
                return Response(content, upstream.status_code, answer_headers(upstream))
        except httpx.PoolTimeout:  # the router's own limit (--max-connections), not the decode
            release_all()
            message = "the router is at its connection limit (--max-connections)"
            return JSONResponse(error_body(message), 503, {"retry-after": "1"})
        except httpx.HTTPError as e:
            release_all()
            logger.warning("decode %s failed before answering: %s", up.decode.name, e)
            self.set_health(up.decode, False)
            return None
        except _ClientGone:  # its upstream connection is closed: the decode aborts it
            release_all()
            return Response(status_code=CLIENT_CLOSED)
        except _PastDeadline:
            release_all()
            message = f"the request passed its deadline ({self.timeout_s} s)"
            return JSONResponse(error_body(message, "timeout"), 504)
        prefill = up.prefill
        first_byte = (lambda: release(prefill)) if prefill is not None else (lambda: None)
        if upstream.status_code != 200:  # the decode's refusal, whole: nothing to follow
            up = replace(up, follower=None)
        relay = _Relay(self, up, client, deadline, first_byte)
        relay.done, relay.release = release_all, release
        return StreamingResponse(
            relay.events(upstream), upstream.status_code, answer_headers(upstream)
        )

    def follow(self, relay: _Relay) -> None:
        """Count `relay` among the streams relayed now, watched for a silent dead decode."""
        self.relays.add(relay)
        if self._watch is None or self._watch.done():
            self._watch = asyncio.ensure_future(self._watch_silence())

    async def _watch_silence(self) -> None:
        """End the upstream of every stream whose decode the health probes find dead while it
        sends nothing (a host gone without closing its connections): its read then fails, and
        the stream goes on elsewhere (or ends with an error) instead of waiting out its
        deadline. One watcher for all streams, while there are any."""
        while self.relays:
            await asyncio.sleep(SILENT_CHECK_S)
            for relay in [r for r in self.relays if r.silent_on_dead()]:
                if relay.up.follower is None or self.resume_on(relay.tried) is None:
                    continue  # cut, it could not go on anywhere: it waits for its decode

                logger.warning("decode %s is unhealthy and silent mid-stream", relay.decode.name)
                relay.close_upstream()

    def stop(self) -> None:
        """Stop watching the streams (the router stops)."""
        if self._watch is not None:
            self._watch.cancel()

    def movable(self, decode: Node) -> dict[str, _Relay]:
        """The streams relayed from `decode` that can go on elsewhere, by their request id
        there."""
        return {
            r.up.follower.request_id: r
            for r in self.relays
            if r.decode is decode and r.up.follower is not None and not r.moving
        }


class _DecodeFailed(Exception):
    pass


class _Relay:
    """One streamed answer relayed to the client, moved to another decode if its own fails
    mid-stream and the stream can go on (`up.follower`)."""

    def __init__(
        self,
        forwarder: Forwarder,
        up: Upstream,
        client: Request,
        deadline: float,
        first_byte: Callable[[], None],
    ) -> None:
        self.fw = forwarder
        self.up = up
        self.client = client
        self.deadline = deadline
        self.first_byte = first_byte
        self.done: Callable[[], None] = lambda: None  # releases what the first attempt held
        self.release: Callable[[Node], None] = lambda node: None  # one of those
        self.decode = up.decode  # where the stream comes from now
        self.upstream: httpx.Response | None = None
        self.moving = False  # asked to leave its decode (a drain), which did not fail
        self.migrate_from: dict[str, str] | None = None  # where its paused KV is (hand_over)
        self.last_data = time.monotonic()  # when the decode last sent something
        self.tried: tuple[str, ...] = (up.decode.name,)
        self.holding: list[Node] = []  # decodes it moved to that count it in `in_flight`
        # The decode a handed-over stream's KV is fetched from: counted in its `in_flight`
        # until the next decode sends (which it does once the fetch is over), so a drain
        # waiting for that count does not let it stop mid-fetch.
        self.fetched_from: Node | None = None

    def move(self) -> None:
        """Leave the current decode for another (its connection closed: the request aborts
        there); the stream goes on as after a failure, without marking the decode failed."""
        if self.upstream is not None and not self.moving:
            self.moving = True
            self.close_upstream()

    def hand_over(self, address: str) -> None:
        """Its decode paused it (`POST /admin/migrate`) and ends its stream: it goes on from
        another decode, which fetches its KV from `address` (that decode's gRPC)."""
        assert self.up.follower is not None
        self.moving = True
        self.migrate_from = {"address": address, "handle": self.up.follower.request_id}

    def close_upstream(self) -> None:
        """Close the current decode's connection: the stream's read of it fails."""
        if self.upstream is not None:
            asyncio.ensure_future(self.upstream.aclose())

    def silent_on_dead(self) -> bool:
        """Whether its decode, found dead by the health probes, has sent nothing lately."""
        silent = time.monotonic() - self.last_data >= SILENT_CHECK_S
        return silent and not self.decode.healthy and self.upstream is not None

    async def events(self, upstream: httpx.Response) -> AsyncIterator[bytes]:
        up, follower = self.up, self.up.follower
        self.upstream = upstream
        self.fw.follow(self)
        if up.decode.draining:  # drained after it was chosen, before the stream started
            self.move()
        try:
            while True:
                try:
                    async for data in self._read(upstream):
                        self.last_data = time.monotonic()
                        if self.fetched_from is not None:
                            self._leave(self.fetched_from)
                            self.fetched_from = None
                        up.on_answer(data)
                        out = follower.feed(data) if follower is not None else data
                        if out:
                            self.first_byte()
                            yield out
                    if follower is None or follower.finished:
                        return
                    raise _DecodeFailed("its stream ended before the answer did")
                except _DecodeFailed as e:
                    if self.moving:
                        logger.info("moving a stream off %s (drained)", up.decode.name)
                    else:
                        logger.warning("decode %s failed mid-stream: %s", up.decode.name, e)
                        self.fw.set_health(up.decode, False)
                    await upstream.aclose()
                    if self.fetched_from is not None:  # it fails before the fetch was over
                        self._leave(self.fetched_from)
                    self.fetched_from = None
                    if self.migrate_from is not None:
                        self.fetched_from = up.decode  # left once the next decode sends
                    else:
                        self._leave(up.decode)
                    if follower is None:
                        message = f"the decode entrance failed mid-stream: {e}"
                        yield f"data: {json.dumps(error_body(message))}\n\n".encode() + DONE
                        return
                    if follower.finished:  # only [DONE] was missing
                        yield DONE
                        return
                    moved = await self._resume(follower)
                    if moved is None:
                        self.fw.resume_failed.inc()
                        message = (
                            f"the decode entrance failed mid-stream ({e}); no other could go on"
                        )
                        yield f"data: {json.dumps(error_body(message))}\n\n".encode() + DONE
                        return
                    follower.moved()
                    up, upstream = moved
                    self.decode, self.upstream, self.moving = up.decode, upstream, False
        except TimeoutError:
            message = f"the request passed its deadline ({self.fw.timeout_s} s)"
            yield f"data: {json.dumps(error_body(message, 'timeout'))}\n\n".encode() + DONE
        finally:
            self.fw.relays.discard(self)
            self.done()
            for node in self.holding:
                node.in_flight -= 1
            await upstream.aclose()

    def _leave(self, decode: Node) -> None:
        """The stream no longer comes from `decode`: it stops counting it as in flight."""
        if any(n is decode for n in self.holding):
            self.holding = [n for n in self.holding if n is not decode]
            decode.in_flight -= 1
        else:
            self.release(decode)

    async def _read(self, upstream: httpx.Response) -> AsyncIterator[bytes]:
        """The decode's bytes as they come; `_DecodeFailed` when its connection breaks."""
        chunks = upstream.aiter_raw()
        while True:
            try:
                left = max(0.0, self.deadline - time.monotonic())
                data = await asyncio.wait_for(anext(chunks), left)
            except StopAsyncIteration:
                return
            except (httpx.HTTPError, httpx.StreamError) as e:  # StreamClosed: moved (`move`)
                raise _DecodeFailed(type(e).__name__) from e
            yield data

    async def _resume(self, follower: StreamFollower) -> tuple[Upstream, httpx.Response] | None:
        """The stream's next decode and its answer (200), or None when none can go on."""
        body = follower.resume_body(self.up.body, self.migrate_from)
        migrated, self.migrate_from = self.migrate_from is not None, None
        raw = json.dumps(body).encode()
        while len(self.tried) <= MAX_RESUMES:
            decode = self.fw.resume_on(self.tried)
            if decode is None:
                return None
            self.tried += (decode.name,)
            follower.request_id = uuid.uuid4().hex
            headers = {
                **self.up.headers,
                PREFILL_HEADER: LOCAL_PREFILL,
                REQUEST_ID_HEADER: follower.request_id,
            }
            up = replace(self.up, decode=decode, prefill=None, raw=raw, headers=headers)
            decode.in_flight += 1
            try:
                # Not watching the client here: inside a streaming response Starlette's own
                # disconnect listener ends the stream (two readers would race for the message).
                upstream = await self.fw.send(up, None, self.deadline)
            except (httpx.HTTPError, _ClientGone, _PastDeadline) as e:
                decode.in_flight -= 1
                if isinstance(e, httpx.HTTPError):
                    self.fw.set_health(decode, False)
                    continue
                return None
            if upstream.status_code != 200:
                text = (await upstream.aread())[:500]
                await upstream.aclose()
                decode.in_flight -= 1
                logger.warning("decode %s refused to resume a stream: %s", decode.name, text)
                continue
            logger.info(
                "stream %s on %s after %d tokens",
                "migrated" if migrated else "resumed",
                decode.name,
                len(follower.token_ids),
            )
            (self.fw.migrated if migrated else self.fw.resumed).inc()
            self.holding.append(decode)
            return up, upstream
        return None


@dataclass(frozen=True)
class Upstream:
    """One attempt at a request: where it goes and what is sent (`body`: `raw` parsed;
    `follower`: a stream that may move to another decode if this one fails)."""

    decode: Node
    prefill: Node | None
    path: str
    raw: bytes
    headers: dict[str, str]
    stream: bool
    body: dict[str, Any] = field(default_factory=dict)
    follower: StreamFollower | None = None
    # sees the answer's bytes as they pass (whole, or chunk by chunk): the routing audit
    on_answer: Callable[[bytes], None] = lambda data: None


async def _bounded(work: Awaitable[Any], client: Request | None, deadline: float) -> Any:
    """`work`'s result, unless the client goes away (`_ClientGone`; watched where `client` is
    given) or the deadline passes (`_PastDeadline`) first: then `work` is cancelled (its
    connection closed)."""
    task = asyncio.ensure_future(work)
    waits: set[asyncio.Future[Any]] = {task}
    gone = asyncio.ensure_future(client_gone(client)) if client is not None else None
    if gone is not None:
        waits.add(gone)
    try:
        left = max(0.0, deadline - time.monotonic())
        done, _ = await asyncio.wait(waits, timeout=left, return_when="FIRST_COMPLETED")
    finally:
        if gone is not None:
            gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise _ClientGone() if gone in done else _PastDeadline()
