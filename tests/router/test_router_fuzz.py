"""The router's API fuzzed with schemathesis: requests generated from the OpenAI schema the
nodes publish (valid and invalid bodies) sent to a real router over HTTP, in front of a real
colocated node (a tiny random model, context capped at 64 tokens), both in this process. No
request gets a 5xx, no body carries a traceback, every 4xx is an OpenAI error body, and the
decode stays healthy in the router's eyes. Examples per operation are bounded."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis

from pdserve.api.metrics import ServingMetrics
from pdserve.api.routes import build_app
from pdserve.config import CacheConfig, EngineConfig, NodeConfig, RouterConfig, SchedulerConfig
from pdserve.router.app import Router
from pdserve.serve.http import HttpServer
from pdserve.serve.node import ColocatedNode
from tests.api.test_api_fuzz import MODES, fuzz_operation
from tests.helpers import make_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)  # noqa: E731
    engine = EngineConfig(
        dtype="float32",
        num_threads=1,
        cache=CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(max_model_len=64),
    )
    node = ColocatedNode(engine, Path(model_dir), NodeConfig())
    run(node.start())
    app = build_app(node, ServingMetrics(), "tiny")
    decode = HttpServer(app, "127.0.0.1", 0)
    run(decode.start())
    router = Router(RouterConfig(decodes=(f"http://{decode.address}",), tokenizer=str(model_dir)))
    front = HttpServer(router.app, "127.0.0.1", 0)

    async def start_router() -> None:
        await router.start()
        await front.start()

    run(start_router())
    try:
        yield schemathesis.openapi.from_dict(app.openapi()), f"http://{front.address}"
    finally:
        run(front.stop())
        run(router.stop())
        run(decode.stop())
        run(node.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_the_router_answers_every_request_with_no_5xx(routed: tuple[Any, str], mode: Any) -> None:
    schema, url = routed
    routed_paths = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    operations = [r.ok() for r in schema.get_all_operations() if r.ok().path in routed_paths]
    assert {op.path for op in operations} == routed_paths
    for operation in operations:
        fuzz_operation(operation, mode, lambda case: case.call(base_url=url), examples=20)
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["status"] == "ok", health
