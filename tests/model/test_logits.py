"""Logits of pdserve's model vs Hugging Face transformers on the same weights, through the
paged cache in one pass, in chunks and token by token."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from pdserve.model.fused import paged_decode_kernel
from tests.helpers import engine_logits, make_engine, make_tiny_model

# fp32 should agree to rounding; bf16 rounds every activation to 8 bits of mantissa, so the
# tolerance is relative to the logits' scale.
FP32_ATOL = 1e-4
BF16_REL = 0.03

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

TINY_VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True}),
    "qwen2-qkv-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "gemma": ("gemma", {}),
    "gemma3": ("gemma3", {}),
    # windows shorter than the prompts (32, 45 tokens): the windowed layers see only the last 8
    "gemma3-window": ("gemma3", {"sliding_window": 8}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen2-window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),  # fmt: skip
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
}


def hf_logits(model_dir: Path, token_ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
@pytest.mark.parametrize("length", [32, 45])  # a multiple of the block size (16) and not
def test_tiny_model_matches_transformers_fp32(tmp_path: Path, variant: str, length: int) -> None:
    arch, overrides = TINY_VARIANTS[variant]
    model_dir = make_tiny_model(tmp_path / variant, arch, **overrides)
    tokens = torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(model_dir, tokens, torch.float32)
    engine = make_engine(model_dir)
    one_pass = engine_logits(engine, tokens, [length])
    chunks = [20, length - 23, 1, 1, 1]
    chunked = engine_logits(engine, tokens, chunks)
    compiled = engine_logits(engine, tokens, chunks, paged_decode_kernel())
    assert (one_pass - ref).abs().max() < FP32_ATOL
    assert (chunked - ref).abs().max() < FP32_ATOL
    assert (compiled - ref).abs().max() < FP32_ATOL


@pytest.mark.parametrize("bf16_matmul", ["bf16", "fp32"])
def test_tiny_model_matches_transformers_bf16(tmp_path: Path, bf16_matmul: str) -> None:
    model_dir = make_tiny_model(tmp_path / "tiny")
    tokens = torch.randint(3, 256, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_logits(model_dir, tokens, torch.bfloat16)
    engine = make_engine(model_dir, dtype="bfloat16", bf16_matmul=bf16_matmul)
    ours = engine_logits(engine, tokens, [30, 13, 1, 1])
    scale = ref.abs().max()
    assert (ours - ref).abs().max() < BF16_REL * scale


@pytest.mark.slow
@pytest.mark.parametrize("length", [48, 77])
def test_smollm2_gguf_matches_transformers(
    smollm_fp32_dir: Path, hf_smollm: torch.nn.Module, length: int
) -> None:
    """pdserve's GGUF conversion (dequantize, un-permute q/k) vs transformers' own GGUF loader."""
    text = "The quick brown fox jumps over the lazy dog. " * 12
    engine = make_engine(smollm_fp32_dir)
    tokens = engine.tokenizer.encode(text)[:length]
    with torch.no_grad():
        ref = hf_smollm(torch.tensor([tokens])).logits[0].float()
    ours = engine_logits(engine, tokens, [length - 3, 1, 1, 1])
    assert (ours - ref).abs().max() < 2e-3  # 30 layers of fp32 with different op order


@pytest.mark.slow
def test_smollm2_wide_bf16_stays_within_bf16_noise(
    smollm_bf16_dir: Path,
    hf_smollm,  # type: ignore[no-untyped-def]
) -> None:
    """transformers' bf16 and fp32 SmolLM2 differ by bf16's rounding; pdserve's bf16 with
    every matmul in fp32 must not differ from the fp32 model by more than that, and must pick
    the same top token as transformers' bf16 almost everywhere (teacher-forced)."""
    text = "In a village by the sea, the fishermen told stories of the storms they had seen. "
    engine = make_engine(smollm_bf16_dir, dtype="bfloat16", bf16_matmul="fp32")
    tokens = engine.tokenizer.encode(text * 8)[:150]
    ours = engine_logits(engine, tokens, [100, len(tokens) - 103, 1, 1, 1])
    with torch.no_grad():
        ref32 = hf_smollm(torch.tensor([tokens])).logits[0].float()
        hf_bf16 = copy.deepcopy(hf_smollm).to(torch.bfloat16)  # the fixture stays fp32
        ref16 = hf_bf16(torch.tensor([tokens])).logits[0].float()
    bf16_noise = (ref16 - ref32).abs().mean()
    assert (ours - ref32).abs().mean() <= 1.5 * bf16_noise
    agree = (ours.argmax(-1) == ref16.argmax(-1)).float().mean()
    assert agree >= 0.95


def test_the_windowed_layers_are_those_transformers_windows() -> None:
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config

    from pdserve.config import ModelConfig

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, max_position_embeddings=8192)  # fmt: skip
    cases = {
        "mistral": (MistralConfig, {"sliding_window": 4096}),
        "mistral-none": (MistralConfig, {"sliding_window": None}),
        "qwen2-off": (Qwen2Config, {"sliding_window": 512, "use_sliding_window": False}),
        "qwen2-on": (
            Qwen2Config,
            {"sliding_window": 512, "use_sliding_window": True, "max_window_layers": 2},
        ),  # fmt: skip
        "gemma3": (Gemma3TextConfig, {"sliding_window": 512, "head_dim": 16}),
    }
    for name, (hf_class, extra) in cases.items():
        hf = hf_class(**base, **extra)
        ours = ModelConfig.from_hf_dict(hf.to_dict())
        types = (
            getattr(hf, "layer_types", None)
            or ["sliding_attention" if hf.sliding_window else "full_attention"] * 4
        )  # Mistral windows every layer where it has a window
        want = tuple(
            i for i, t in enumerate(types) if t == "sliding_attention" and hf.sliding_window
        )
        assert ours.local_layers == want, name
        assert ours.sliding_window == (hf.sliding_window if want else None), name
        assert ours.max_position == 8192, name  # the window does not cap the context
