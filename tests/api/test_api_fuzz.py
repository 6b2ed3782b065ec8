"""API fuzzing with schemathesis: requests generated from the app's own OpenAPI schema (valid
and invalid bodies) against the real app over a real colocated node (a tiny random model with
a chat template, context capped at 64 tokens so every request is cheap), in-process through
ASGI. No request gets a 5xx, no body carries a traceback, and every 4xx is an OpenAI error
body. The example count per operation is bounded to keep the suite short."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from pdserve.api.metrics import ServingMetrics
from pdserve.api.routes import build_app
from pdserve.config import CacheConfig, EngineConfig, NodeConfig, SchedulerConfig
from pdserve.serve.node import ColocatedNode
from tests.helpers import make_tiny_model

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s> {% endfor %}"
    "{% if add_generation_prompt %}<s>assistant {% endif %}"
)


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    config_path = model_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = EngineConfig(
        dtype="float32",
        num_threads=1,
        cache=CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(max_model_len=64),
    )
    node = ColocatedNode(engine, Path(model_dir), NodeConfig())
    asyncio.run_coroutine_threadsafe(node.start(), loop).result(60)
    try:
        app = build_app(node, ServingMetrics(), "tiny")
        yield schemathesis.openapi.from_asgi("/openapi.json", app)
    finally:
        asyncio.run_coroutine_threadsafe(node.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)


def check(response: Any) -> None:
    assert response.status_code < 500, response.text[:500]
    assert "Traceback" not in response.text
    if 400 <= response.status_code < 500:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and error["type"]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_no_5xx_no_traceback_and_openai_errors(api_schema: Any, mode: Any) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    for operation in operations:
        if mode == schemathesis.GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # no parameters to break
        fuzz_operation(operation, mode, lambda case: case.call())


def fuzz_operation(
    operation: Any, mode: Any, call: Callable[[Any], Any], examples: int = 25
) -> None:
    """`examples` cases of `operation` in `mode`, each sent by `call`, each answer `check`ed."""

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        check(call(case))

    fuzz()
