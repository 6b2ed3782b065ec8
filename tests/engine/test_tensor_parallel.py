"""Tensor parallelism in the engine: a tiny random Llama (fp32, 8 attention heads, 4 KV heads)
sharded over 2 ranks (KV heads split) and over 8 ranks (KV heads replicated), and a tiny Gemma 3
with one KV head and a sliding window shorter than the prompts over 2, computes the logits of
one rank within fp32 tolerance and generates the same greedy tokens; a size the heads
do not allow is refused naming them; a rank that dies fails the step at once, naming it, and
every later step; a dead rank 0 takes its workers with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdserve.config import CacheConfig, ConfigError, EngineConfig, ModelConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import SamplingParams, Sequence
from pdserve.model.parallel import check_shardable
from tests.helpers import assert_all_free, make_tiny_model

pytestmark = pytest.mark.slow

PROMPTS = [[3 + (11 * i + 7 * j) % 250 for j in range(5 + 9 * i)] for i in range(8)]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=True,
                        top_logprobs=3)  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny(tmp_path_factory, kv_heads=4)


def tiny(tmp_path_factory: pytest.TempPathFactory, kv_heads: int, arch: str = "llama") -> Path:
    extra = {"sliding_window": 12} if arch == "gemma3" else {}  # prompts of 5 to 68 tokens
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-tp"),
        arch,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        **extra,
    )


def engine(model: Path, tp: int) -> LLMEngine:
    config = EngineConfig(
        dtype="float32",
        num_threads=1,
        cache=CacheConfig(num_blocks=96),
        tensor_parallel_size=tp,
    )
    return LLMEngine(config, model)


def prompt_logits(e: LLMEngine, ids: list[int]) -> torch.Tensor:
    """The logits after the whole prompt, through the engine's runner (every rank computes)."""
    seq = Sequence("logits", ids, SamplingParams(max_tokens=1))
    e.kv.allocate(seq)
    try:
        return e.runner.execute(SchedulerOutput([ScheduledSeq(seq, len(ids), sample=True)]))[0]
    finally:
        e.kv.free(seq)


@pytest.mark.parametrize(
    ("arch", "kv_heads", "tp"),
    [("llama", 4, 2), ("llama", 2, 4), ("gemma3", 1, 2)],
    ids=["2-ranks-kv-split", "4-ranks-kv-replicated", "gemma3-window-2-ranks"],
)
def test_sharded_logits_and_greedy_tokens_equal_one_rank(
    tmp_path_factory: pytest.TempPathFactory, arch: str, kv_heads: int, tp: int
) -> None:
    model = tiny(tmp_path_factory, kv_heads, arch)
    single = engine(model, 1)
    sharded = engine(model, tp)
    try:
        assert sharded.model.config.num_heads == 8 // tp
        assert sharded.model.config.num_kv_heads == max(kv_heads // tp, 1)
        assert sharded.kv_caches[0].shape[2] == max(kv_heads // tp, 1)  # its KV heads only
        for ids in PROMPTS:
            torch.testing.assert_close(
                prompt_logits(sharded, ids), prompt_logits(single, ids), rtol=1e-4, atol=1e-4
            )
        ours = sharded.generate(PROMPTS, GREEDY)
        ref = single.generate(PROMPTS, GREEDY)
        for o, r in zip(ours, ref, strict=True):
            assert o.token_ids == r.token_ids
            assert len(o.token_ids) == 32
            torch.testing.assert_close(o.logprobs, r.logprobs, rtol=0, atol=1e-4)
            top = lambda out: [[t for t, _ in step] for step in out.top_logprobs]  # noqa: E731
            assert top(o) == top(r)
        assert_all_free(sharded)
    finally:
        sharded.close()


def test_a_size_the_heads_do_not_allow_is_refused_naming_them(model: Path) -> None:
    smollm_like = replace(
        ModelConfig.from_dir(model), num_heads=9, num_kv_heads=3, intermediate_size=1536
    )
    with pytest.raises(ConfigError, match="9 attention heads and 3 KV heads"):
        check_shardable(smollm_like, 2)
    with pytest.raises(ConfigError, match="8 attention heads and 4 KV heads"):
        engine(model, 3)
    check_shardable(smollm_like, 3)  # 3 ranks: 3 heads and 1 KV head each


def test_a_dead_rank_fails_the_step_naming_it_and_every_later_one(model: Path) -> None:
    sharded = engine(model, 2)
    try:
        assert sharded.tp is not None
        (worker,) = sharded.tp.pids
        os.kill(worker, signal.SIGKILL)
        start = time.monotonic()
        (failed,) = sharded.generate([PROMPTS[3]], GREEDY)
        assert time.monotonic() - start < 10  # the closed connection, not the 30 s timeout
        assert failed.error is not None and "rank 1 died" in failed.error, failed.error
        (again,) = sharded.generate([PROMPTS[0]], GREEDY)  # refused at once, same reason
        assert again.error is not None and "rank 1 died" in again.error, again.error
        assert_all_free(sharded)
    finally:
        sharded.close()


def test_workers_exit_when_rank_0_is_killed(model: Path) -> None:
    script = (
        "import sys, time\n"
        "from tests.engine.test_tensor_parallel import engine\n"
        "e = engine(__import__('pathlib').Path(sys.argv[1]), 2)\n"
        "print(*e.tp.pids, flush=True)\n"
        "time.sleep(600)\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(model)], cwd=root, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 1 and Path(f"/proc/{pids[0]}").exists()
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pids[0]}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{pids[0]}").exists(), "the worker outlived its rank 0"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_served_node_whose_rank_died_fails_requests_and_reports_unhealthy(model: Path) -> None:
    """Through the HTTP API of a colocated node: the request fails naming the rank, and
    /health turns 503 with the same reason (a router stops sending it requests)."""
    import asyncio

    import httpx

    from pdserve.api.metrics import ServingMetrics
    from pdserve.api.routes import build_app
    from pdserve.config import NodeConfig
    from pdserve.serve.node import ColocatedNode

    config = EngineConfig(
        dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=96), tensor_parallel_size=2
    )

    async def scenario() -> None:
        node = ColocatedNode(config, model, NodeConfig())
        await node.start()
        try:
            app = build_app(node, ServingMetrics(), "tiny")
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
                body = {"model": "tiny", "prompt": "t5 t9 t17", "max_tokens": 4}
                assert (await client.post("/v1/completions", json=body)).status_code == 200
                assert (await client.get("/health")).status_code == 200
                engine = node._started_engine
                assert engine.tp is not None
                os.kill(engine.tp.pids[0], signal.SIGKILL)
                failed = await client.post("/v1/completions", json=body)
                assert failed.status_code >= 500
                assert "rank 1 died" in failed.json()["error"]["message"], failed.text
                health = await client.get("/health")
                assert health.status_code == 503 and "rank 1 died" in health.json()["detail"]
        finally:
            await node.stop()

    asyncio.run(scenario())
