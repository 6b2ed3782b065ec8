"""The router in process: its event loop is never the one tokenizing (while a prompt is held
in the tokenizer for the prefix index, the router still answers others); it serves HTTPS and
reaches decodes over HTTPS, trusting the CA it is given; a drain waits for the streams it
handed over to fetch their KV."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from pdserve.config import RouterConfig
from pdserve.router.app import Router
from tests.helpers import make_tiny_model


def test_indexing_a_prompt_runs_off_the_event_loop(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    router = Router(RouterConfig(decodes=("http://127.0.0.1:9",), tokenizer=str(model)))
    assert router.prompts.tokenizer is not None
    entered, release = threading.Event(), threading.Event()
    inside = False
    encode = router.prompts.tokenizer.encode

    def held_encode(text: str) -> list[int]:  # a prompt that takes long to tokenize
        nonlocal inside
        inside = True
        entered.set()
        release.wait(10)
        inside = False
        return encode(text)

    router.prompts.tokenizer.encode = held_encode  # type: ignore[method-assign]

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=router.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
            body = {"model": "m", "prompt": "t5 t9 " * 100}
            routed = asyncio.ensure_future(client.post("/v1/completions", json=body))
            await asyncio.to_thread(entered.wait, 10)
            health = await asyncio.wait_for(client.get("/health"), 5)
            answered_while_tokenizing = inside
            release.set()
            r = await routed
        assert health.status_code == 200
        assert answered_while_tokenizing, "the router's loop waited for the tokenizer"
        assert r.status_code == 503  # no decode behind it: answered all the same

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        asyncio.run(router.stop())


def test_the_router_serves_https_and_reaches_decodes_over_https(tmp_path: Path) -> None:
    """With --tls-cert/--tls-key the router speaks HTTPS (a plain-HTTP client is refused), and
    with --tls-ca it probes and forwards to a decode served over HTTPS (here: another
    router standing in for a decode's HTTP surface: /health and /metrics)."""
    import ssl

    import trustme

    from pdserve.config import TlsFiles
    from pdserve.serve.http import HttpServer

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    paths = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "ca")}
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    ca.cert_pem.write_to_path(str(paths["ca"]))
    tls = TlsFiles(str(paths["cert"]), str(paths["key"]), str(paths["ca"]))

    async def scenario() -> None:
        inner = Router(RouterConfig(decodes=("http://127.0.0.1:9",)))
        inner_server = HttpServer(inner.app, "127.0.0.1", 0, tls)
        await inner_server.start()
        outer = Router(RouterConfig(decodes=(f"https://{inner_server.address}",), tls=tls))
        outer_server = HttpServer(outer.app, "127.0.0.1", 0, tls)
        await outer_server.start()
        try:
            await outer.monitor.poll_once()  # over HTTPS, trusting the CA
            assert outer.decodes[0].healthy
            trusting = ssl.create_default_context(cafile=str(paths["ca"]))
            async with httpx.AsyncClient(verify=trusting) as client:
                r = await client.get(f"https://{outer_server.address}/health")
                assert r.status_code == 200 and r.json()["decodes"] == list(outer.config.decodes)
            async with httpx.AsyncClient() as plain:
                with pytest.raises(httpx.HTTPError):
                    await plain.get(f"http://{outer_server.address}/health")
        finally:
            await outer_server.stop()
            await outer.stop()
            await inner_server.stop()
            await inner.stop()

    asyncio.run(scenario())


def test_a_slow_decode_is_not_dead_but_a_silent_or_refusing_one_is() -> None:
    """One health probe left unanswered (a decode busy computing) keeps the decode in rotation;
    two in a row take it out, and an answer puts it back; a refused connection takes it out at
    once. The decode here: a real HTTP server whose /health answers late when told to."""

    from pdserve.serve.http import HttpServer

    late = {"by_s": 0.0}
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        await asyncio.sleep(late["by_s"])
        return Response("{}", media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response("vllm:num_requests_running 0\n", media_type="text/plain")

    async def scenario() -> list[bool]:
        server = HttpServer(app, "127.0.0.1", 0)
        await server.start()
        router = Router(RouterConfig(decodes=(f"http://{server.address}",), probe_timeout_s=0.2))
        node = router.decodes[0]
        seen = []
        try:
            for by_s in (0.0, 0.5, 0.5, 0.0):
                late["by_s"] = by_s
                await router.monitor.poll_once()
                seen.append(node.healthy)
            await server.stop()
            server = None  # type: ignore[assignment]
            await router.monitor.poll_once()  # nobody listens: refused
            seen.append(node.healthy)
        finally:
            if server is not None:
                await server.stop()
            await router.stop()
        return seen

    assert asyncio.run(scenario()) == [True, True, False, True, False]


def test_a_decode_the_probes_marked_unavailable_is_tried_when_none_is_healthy() -> None:
    """A decode whose probes fail (here its /health answers 503; on a busy host, two probes
    left unanswered) while it still serves gets the requests when no decode is healthy, rather
    than the router refusing them; a drained one never does, and a dead one ends in a 503
    naming it. The decode: a real HTTP server."""

    from pdserve.serve.http import HttpServer

    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response('{"status": "unavailable"}', 503, media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response("vllm:num_requests_running 0\n", media_type="text/plain")

    @app.post("/v1/completions")
    async def complete() -> Response:
        body = {"id": "cmpl-1", "object": "text_completion", "choices": [{"text": " t5"}]}
        return Response(json.dumps(body), media_type="application/json")

    async def scenario() -> None:
        server = HttpServer(app, "127.0.0.1", 0)
        await server.start()
        url = f"http://{server.address}"
        router = Router(RouterConfig(decodes=(url,)))
        node = router.decodes[0]
        body = {"model": "m", "prompt": "t5 t9"}
        try:
            await router.monitor.poll_once()
            assert not node.healthy
            transport = httpx.ASGITransport(app=router.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == " t5"
                assert router.registry.get_sample_value("pdserve:router_last_resort_total") == 1
                node.draining = True
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 503 and "none healthy" in r.text
                node.draining = False
                await server.stop()
                server = None  # nobody listens: the connection is refused
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 503 and url in r.text
        finally:
            if server is not None:
                await server.stop()
            await router.stop()

    asyncio.run(scenario())


class FakeDecode:
    """A decode entrance's HTTP surface as the router uses it: /health, /metrics, a streamed
    completion of one token every 10 ms, and `POST /admin/migrate`, which pauses the stream (it
    ends without [DONE]) as a real decode does. A stream resumed here with `migrate_from`
    "fetches" its KV until the test sets `fetched`, then sends its last tokens."""

    def __init__(self) -> None:
        self.streaming = asyncio.Event()  # a stream's first two tokens went out from here
        self.paused = asyncio.Event()
        self.fetching = asyncio.Event()  # a migrated stream arrived
        self.fetched = asyncio.Event()
        app = FastAPI()

        def event(token: int, finish: str | None = None) -> bytes:
            choice = {"index": 0, "text": f" t{token}", "token_ids": [token]}
            body = {"id": "cmpl-1", "created": 1, "choices": [{**choice, "finish_reason": finish}]}
            return b"data: " + json.dumps(body).encode() + b"\n\n"

        @app.get("/health")
        async def health() -> Response:
            return Response("{}", media_type="application/json")

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response("vllm:num_requests_running 0\n", media_type="text/plain")

        @app.post("/admin/migrate")
        async def migrate(request: Request) -> Response:
            ids = (await request.json())["request_ids"]
            self.paused.set()
            body = {"address": "127.0.0.1:9", "migrated": ids}
            return Response(json.dumps(body), media_type="application/json")

        @app.post("/v1/completions")
        async def complete(request: Request) -> StreamingResponse:
            resume = (await request.json()).get("pdserve_resume")

            async def tokens() -> AsyncIterator[bytes]:
                if resume is None:
                    for token in range(1, 1000):
                        if self.paused.is_set():
                            return  # paused: the stream ends here, unfinished
                        yield event(token)
                        if token == 2:
                            self.streaming.set()
                        await asyncio.sleep(0.01)
                assert resume["migrate_from"]["address"] == "127.0.0.1:9"
                self.fetching.set()
                await self.fetched.wait()
                after = len(resume["token_ids"]) + 1
                yield event(after)
                yield event(after + 1, "length")
                yield b"data: [DONE]\n\n"

            return StreamingResponse(tokens(), media_type="text/event-stream")

        self.app = app


def test_a_drain_waits_until_the_streams_it_handed_over_have_their_kv() -> None:
    """`Router.drain` of a decode that pauses its stream for a live migration: the other decode
    fetches the stream's KV from the drained one before it sends on, so the drained decode
    counts as in flight — and the drain (after which a rolling restart stops it) does not
    return — until the next decode's first token; the client's stream is whole, each token
    once, and neither decode is left counting it."""
    from pdserve.serve.http import HttpServer

    async def scenario() -> None:
        fakes = [FakeDecode(), FakeDecode()]
        servers = [HttpServer(f.app, "127.0.0.1", 0) for f in fakes]
        for s in servers:
            await s.start()
        urls = tuple(f"http://{s.address}" for s in servers)
        router = Router(RouterConfig(decodes=urls, policy="round_robin"))
        front = HttpServer(router.app, "127.0.0.1", 0)
        await front.start()
        texts: list[str] = []

        async def stream() -> None:
            body = {"model": "m", "prompt": [1, 2, 3], "stream": True, "max_tokens": 1000}
            async with httpx.AsyncClient(timeout=30) as client:
                url = f"http://{front.address}/v1/completions"
                async with client.stream("POST", url, json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            texts.append(json.loads(line[6:])["choices"][0]["text"])

        try:
            await router.monitor.poll_once()
            streamed = asyncio.ensure_future(stream())
            await asyncio.wait_for(
                asyncio.wait([asyncio.ensure_future(f.streaming.wait()) for f in fakes],
                             return_when=asyncio.FIRST_COMPLETED), 10)  # fmt: skip
            source = next(i for i, f in enumerate(fakes) if f.streaming.is_set())
            target = fakes[1 - source]
            drained = asyncio.ensure_future(router.drain(urls[source], 30))
            await asyncio.wait_for(target.fetching.wait(), 10)
            await asyncio.sleep(0.5)  # ten of the drain's polls
            returned_mid_fetch = drained.done()
            target.fetched.set()
            answer = await asyncio.wait_for(drained, 10)
            await asyncio.wait_for(streamed, 10)
            assert not returned_mid_fetch, "the drain returned while the KV was being fetched"
            assert answer["migrated"] == 1 and answer["drained"], answer
            assert texts == [f" t{i}" for i in range(1, len(texts) + 1)]  # each token once
            assert [n.in_flight for n in router.decodes] == [0, 0]
        finally:
            await front.stop()
            await router.stop()
            for s in servers:
                await s.stop()

    asyncio.run(scenario())
