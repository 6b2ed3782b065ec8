"""A client that stops reading a stream: the real API app over a real colocated node, driven
through ASGI with a `send` that never returns after the first chunks (what a reader that
stopped looks like to the server once socket buffers are full). The request is ended as
"reader gone" after the idle limit, long before its tokens run out, and frees its blocks."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.api.metrics import ServingMetrics
from pdserve.api.routes import build_app
from pdserve.config import CacheConfig, EngineConfig, NodeConfig
from pdserve.serve.node import ColocatedNode

pytestmark = pytest.mark.slow


def test_a_stream_left_unread_is_ended_after_the_idle_limit(smollm_fp32_dir: Path) -> None:
    async def scenario() -> tuple[dict[str, Any], int]:
        engine = EngineConfig(dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=256))
        node = ColocatedNode(engine, smollm_fp32_dir, NodeConfig(reader_idle_timeout_s=1.0))
        await node.start()
        app = build_app(node, ServingMetrics(), "m")
        body = json.dumps(
            {"model": "m", "prompt": "Once upon a time", "max_tokens": 2000, "stream": True,
             "ignore_eos": True}
        ).encode()  # fmt: skip
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        headers = [(b"content-type", b"application/json")]
        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": headers, "query_string": b""}  # fmt: skip
        chunks = 0

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # the client never disconnects either
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            nonlocal chunks
            if message["type"] == "http.response.body":
                chunks += 1
                if chunks >= 3:
                    await asyncio.Event().wait()  # the reader stopped: this send never returns

        task = asyncio.ensure_future(app(scope, receive, send))
        try:
            deadline = time.monotonic() + 120
            while not node.snapshot().requests_finished:
                assert time.monotonic() < deadline, "the unread stream was never ended"
                await asyncio.sleep(0.1)
            snap = node.snapshot()
            return dict(snap.requests_finished or {}), snap.kv_blocks_used
        finally:
            task.cancel()
            await node.stop()

    finished, used = asyncio.run(scenario())
    assert finished == {"error": 1}  # ended as "reader gone", not at its 2000th token
    assert used == 0
