"""Fixtures shared by the disaggregation tests: held-out prompts and the colocated engine's
greedy outputs for them (the reference every disaggregated run is compared with)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from tests.helpers import THREADS

TEXTS = [
    "The history of the printing press begins in",
    "Write a recipe for pancakes. Ingredients:",
    "In a distant galaxy, a small robot named Pip discovered",
    "def quicksort(arr):\n    ",
    "The three laws of thermodynamics are",
    "Dear hiring manager, I am writing to apply for",
    "A haiku about autumn leaves:",
    "Explain how vaccines work to a ten year old.",
]


@pytest.fixture(scope="session")
def prompts(smollm_fp32_dir: Path) -> list[tuple[list[int], int]]:
    from pdserve.model.tokenizer import Tokenizer

    tok = Tokenizer(smollm_fp32_dir)
    out = []
    for i in range(16):
        ids = tok.encode(TEXTS[i % 8] + " " + "Let us think step by step. " * (i * 3 % 17))
        out.append((ids, 32 + (i * 5) % 9))  # 32-40 output tokens
    return out


@pytest.fixture(scope="session")
def colocated(smollm_fp32_dir: Path, prompts: list[tuple[list[int], int]]) -> list[list[int]]:
    """The reference: the colocated engine, all prompts in one batch (batching does not change
    greedy outputs: tests/engine/test_generation.py)."""
    threads = torch.get_num_threads()
    engine = LLMEngine(
        EngineConfig(dtype="float32", num_threads=THREADS, cache=CacheConfig(num_blocks=512)),
        smollm_fp32_dir,
    )
    try:
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in prompts]
        return [o.token_ids for o in engine.generate([ids for ids, _ in prompts], params)]
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny30(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """For tests of what fails or is cancelled, not of the model: a tiny random one with
    SmolLM2's 30 layers (so a per-layer testing delay paces a transfer alike) and none of its
    weight to load or compute."""
    from tests.helpers import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny30"), num_hidden_layers=30)
