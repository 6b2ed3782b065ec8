"""Decode's side of the router's prefill choice (`x-pdserve-prefill`), through the real HTTP
app over a real decode node (tiny random model, in process): a prefill node that is not one of
decode's own is refused 400 before anything runs; `local` prefills on decode, counted as the
router's reason."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from pdserve.api.metrics import ServingMetrics
from pdserve.api.protocol import PREFILL_HEADER
from pdserve.api.routes import build_app
from pdserve.config import CacheConfig, EngineConfig, HttpConfig, NodeConfig, Secret
from pdserve.engine.snapshot import NodeSnapshot
from pdserve.serve.decode_node import DecodeNode
from tests.disagg.cluster import free_port
from tests.helpers import make_tiny_model

BODY = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0}


def test_decode_checks_the_routers_prefill_choice(tmp_path: Path) -> None:
    own = f"127.0.0.1:{free_port()}"

    async def scenario() -> None:
        engine = EngineConfig(dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=32))
        node = DecodeNode(engine, make_tiny_model(tmp_path / "tiny"), NodeConfig(
            prefill_addresses=(own,), min_prompt_tokens=1
        ))  # fmt: skip
        await node.start()
        try:
            app = build_app(node, ServingMetrics(), "m")
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                stranger = {PREFILL_HEADER: "10.0.0.9:50051"}
                r = await client.post("/v1/completions", json=BODY, headers=stranger)
                assert r.status_code == 400, r.text
                assert PREFILL_HEADER in r.json()["error"]["message"]
                assert NodeSnapshot.total(node.snapshot().not_split) == 0  # nothing ran
                r = await client.post(
                    "/v1/completions", json=BODY, headers={PREFILL_HEADER: "local"}
                )
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 3
                snap = node.engine_thread.snapshot()
                assert NodeSnapshot.count(snap.not_split, "router_local") == 1
                assert NodeSnapshot.count(snap.transfer_bytes, "received") == 0
        finally:
            await node.stop()

    asyncio.run(scenario())


def test_with_a_router_key_only_the_router_chooses_prefill_and_reads_kv_events(
    tmp_path: Path,
) -> None:
    """A client holding the API key may not steer prefill (its header is ignored) nor read
    which prefixes are cached (/kv_events: 403); the router, with its own key, may."""
    own = f"127.0.0.1:{free_port()}"
    client_key, router_key = Secret(b"client-key", 1), Secret(b"router-key", 1)

    async def scenario() -> None:
        engine = EngineConfig(dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=32))
        node = DecodeNode(engine, make_tiny_model(tmp_path / "tiny"), NodeConfig(
            prefill_addresses=(own,), min_prompt_tokens=100
        ))  # fmt: skip
        await node.start()
        try:
            http = HttpConfig(api_key=client_key, router_key=router_key)
            app = build_app(node, ServingMetrics(), "m", http)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                as_client = {"authorization": "Bearer client-key", PREFILL_HEADER: "local"}
                as_router = {"authorization": "Bearer router-key", PREFILL_HEADER: "local"}
                r = await client.post("/v1/completions", json=BODY, headers=as_client)
                assert r.status_code == 200, r.text
                local = lambda: NodeSnapshot.count(  # noqa: E731
                    node.engine_thread.snapshot().not_split, "router_local"
                )
                assert local() == 0  # ignored: decode decided (a short prompt: not split)
                r = await client.post("/v1/completions", json=BODY, headers=as_router)
                assert r.status_code == 200, r.text
                assert local() == 1
                r = await client.get("/kv_events", headers={"authorization": "Bearer client-key"})
                assert r.status_code == 403, r.text
                r = await client.get("/kv_events", headers={"authorization": "Bearer router-key"})
                assert r.status_code == 200, r.text
        finally:
            await node.stop()

    asyncio.run(scenario())
