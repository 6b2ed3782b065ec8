"""End-to-end generation on the bundled SmolLM2 (fp32): against transformers' generate, and
batched/preempted/chunked runs against each request run alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from tests.helpers import assert_all_free, make_engine

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the ocean.",
    "def fibonacci(n):",
    "List three colors:",
    "Explain gravity to a child in one sentence.",
    "1, 2, 3, 4,",
    "The meaning of life is",
    "Translate to French: good morning",
]

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0)
MIXED_OUT = 16  # output tokens of the mixed-length runs (each crosses a block boundary)


@pytest.fixture(scope="module")
def engine(smollm_fp32_dir: Path) -> LLMEngine:
    return make_engine(smollm_fp32_dir, num_blocks=1024)


def test_greedy_matches_transformers_generate(engine: LLMEngine, hf_smollm) -> None:  # type: ignore[no-untyped-def]
    outs = engine.generate(PROMPTS, GREEDY_32)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = engine.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_smollm.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=2
            )[0, len(ids) :].tolist()
        assert out.token_ids == ref, prompt
    assert_all_free(engine)


def mixed_prompts(engine: LLMEngine) -> list[list[int]]:
    base = engine.tokenizer.encode(
        "Once upon a time, in a village by the sea, there lived an old fisherman who "
        "told stories about the storms he had seen and the fish he had caught. "
    )
    prompts = []
    for i in range(12):
        length = 5 + (i * 37) % 260
        prompts.append((base * (1 + length // len(base)))[i : i + length])
    return prompts


@pytest.fixture(scope="module")
def alone(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(max_tokens=MIXED_OUT, temperature=0.0, ignore_eos=True)
    return [engine.generate([p], params)[0].token_ids for p in mixed_prompts(engine)]


# the engines the mixed prompts run on together, against each run alone
BATCH_SETTINGS = pytest.mark.parametrize(
    "setting",
    [
        dict(num_blocks=1024),
        dict(num_blocks=60),  # 12 requests need ~110 blocks at once: forces preemption
        dict(num_blocks=1024, max_batched_tokens=64),  # prompts up to 265 tokens: chunked
    ],
    ids=["batched", "preempted", "chunked"],
)


def assert_setting_exercised(batched: LLMEngine, setting: dict) -> None:
    """The setting did what it is there for (preempted, chunked) and every block is back."""
    stats = batched.scheduler.stats
    if setting.get("num_blocks") == 60:
        assert stats.num_preemptions > 0
    if "max_batched_tokens" in setting:
        assert stats.num_partial_prefills > 0
    assert_all_free(batched)


@BATCH_SETTINGS
def test_batch_equals_alone(
    smollm_fp32_dir: Path, engine: LLMEngine, alone: list[list[int]], setting: dict
) -> None:
    batched = make_engine(smollm_fp32_dir, **setting)
    params = SamplingParams(max_tokens=MIXED_OUT, temperature=0.0, ignore_eos=True)
    outs = batched.generate(mixed_prompts(engine), params)
    assert [o.token_ids for o in outs] == alone
    assert_setting_exercised(batched, setting)


def test_prefix_cache_reuses_blocks_and_keeps_output(
    smollm_fp32_dir: Path, engine: LLMEngine
) -> None:
    shared = engine.tokenizer.encode("You are a careful assistant. Answer briefly. " * 6)
    first = shared + engine.tokenizer.encode("Question: what is 2+2?")
    second = shared + engine.tokenizer.encode("Question: name a planet.")
    params = SamplingParams(max_tokens=16, temperature=0.0)
    cached = make_engine(smollm_fp32_dir, num_blocks=256)
    cached.generate([first], params)
    out = cached.generate([second], params)[0]
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert out.num_cached_tokens == (common // 16) * 16 > 0
    uncached = make_engine(smollm_fp32_dir, num_blocks=256, prefix_caching=False)
    ref = uncached.generate([second], params)[0]
    assert ref.num_cached_tokens == 0
    assert out.token_ids == ref.token_ids
    assert_all_free(cached)
