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
from pdserve.config import CacheConfig, EngineConfig, NodeConfig
from pdserve.disagg.decode_server import DecodeNode
from pdserve.engine.snapshot import NodeSnapshot
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
