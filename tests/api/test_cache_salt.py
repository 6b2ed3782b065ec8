"""The prefix cache is not a cross-tenant oracle, through the real HTTP app over a colocated
node (tiny random model, in process): a request's `cache_salt` (vLLM's field) gives its blocks
keys of their own, so `cached_tokens` counts only hits of the caller's salt — another salt, or
none, reuses nothing; the same salt reuses the prefix. A salt longer than 256 characters is
refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from pdserve.api.metrics import ServingMetrics
from pdserve.api.routes import build_app
from pdserve.config import CacheConfig, EngineConfig, NodeConfig
from pdserve.serve.node import ColocatedNode
from tests.helpers import make_tiny_model

PROMPT = [3 + (7 * i) % 250 for i in range(70)]  # 4 full blocks of 16


def test_cached_tokens_count_only_the_callers_salt(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = EngineConfig(dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=64))
        node = ColocatedNode(engine, make_tiny_model(tmp_path / "tiny"), NodeConfig())
        await node.start()
        try:
            app = build_app(node, ServingMetrics(), "m")
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

                async def cached(salt: str | None) -> int:
                    body = {"model": "m", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
                    if salt is not None:
                        body["cache_salt"] = salt
                    r = await client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

                assert await cached("tenant-a") == 0
                assert await cached("tenant-b") == 0  # the same prompt, another tenant
                assert await cached(None) == 0  # and no salt is a tenant of its own
                assert await cached("tenant-a") == 64  # its own 4 blocks
                assert await cached(None) == 64
                r = await client.post(
                    "/v1/completions",
                    json={"model": "m", "prompt": PROMPT, "max_tokens": 1, "cache_salt": "x" * 257},
                )
                assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"]
        finally:
            await node.stop()

    asyncio.run(scenario())
