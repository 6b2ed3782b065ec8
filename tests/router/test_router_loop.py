"""The router's event loop is never the one tokenizing: while a prompt is being tokenized for
the prefix index (held there on purpose), the router still answers others (the real app,
in process, with the tiny model's tokenizer)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx

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
