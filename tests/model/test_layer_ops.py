"""The compiled elementwise layer ops (csrc/layer_ops.cpp: RMSNorm, residual add + RMSNorm, the
rotary embedding in place, SiLU(gate) * up) give the bits the Python path's torch operators
give (model/llama.py, model/rope.py), at every instruction-set level this CPU executes; the
RMSNorm's sum of squares is the one sum whose order may differ, so it may move a value by one
bf16 step, rarely. And a bf16 model computes the same logits with them as without them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.model.isa import Isa
from pdserve.model.layers import DecoderLayer, RMSNorm
from pdserve.model.rope import apply_rotary
from tests.helpers import TINY_VOCAB, engine_logits, make_engine, make_tiny_model
from tests.model.test_bf16_matmul import level_kernels, ulp_bf16

LEVELS = [Isa.GENERIC, Isa.AVX2, Isa.AVX512]
SHAPES = [(1, 576), (7, 100), (257, 576)]  # a decode row, a length off the vector, a prefill


def rows(shape: tuple[int, int], seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


def assert_norm_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal but for a rare single bf16 step (the order of the sum of squares)."""
    diff = (out.float() - ref.float()).abs()
    assert (diff <= ulp_bf16(ref.float())).all()
    assert (out != ref).float().mean() < 1e-3


def torch_norm(weight: torch.Tensor) -> RMSNorm:
    norm = RMSNorm(weight.numel(), 1e-5).to(torch.bfloat16)
    norm.weight.data.copy_(weight)
    return norm  # its ops are unset: torch's operators


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name.lower())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_norms_and_adds_match_torch(level: Isa, shape: tuple[int, int]) -> None:
    ops = level_kernels(level)
    x, y, weight = rows(shape, 1), rows(shape, 2), rows((shape[1],), 3, 1.0)
    ref = torch_norm(weight)
    assert_norm_close(ops.rms_norm_bf16(x, weight, 1e-5), ref(x))
    total, normed = ops.add_rms_norm_bf16(x, y, weight, 1e-5)
    assert torch.equal(total, x + y)
    assert_norm_close(normed, ref(x + y))
    assert torch.equal(ops.add_bf16(x, y), x + y)


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name.lower())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_silu_mul_matches_torch(level: Isa, shape: tuple[int, int]) -> None:
    ops = level_kernels(level)
    gate_up = rows((shape[0], 2 * shape[1]), 4)
    gate, up = gate_up.split(shape[1], dim=-1)
    assert torch.equal(ops.silu_mul_bf16(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name.lower())
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "dim"), [(1, 9, 3, 64), (37, 4, 2, 20)])
def test_rotary_in_place_matches_torch(
    level: Isa, tokens: int, heads: int, kv_heads: int, dim: int
) -> None:
    ops = level_kernels(level)
    qkv = rows((tokens, (heads + 2 * kv_heads) * dim), 5, 1.0)
    cos, sin = rows((tokens, dim), 6, 1.0), rows((tokens, dim), 7, 1.0)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    want_q = apply_rotary(q.reshape(tokens, heads, dim), cos, sin)
    want_k = apply_rotary(k.reshape(tokens, kv_heads, dim), cos, sin)
    want_v = v.clone()
    ops.rotary_bf16_(qkv, heads + kv_heads, dim, cos, sin)  # q and k are views of qkv
    assert torch.equal(q.reshape(tokens, heads, dim), want_q)
    assert torch.equal(k.reshape(tokens, kv_heads, dim), want_k)
    assert torch.equal(v, want_v)  # v's heads are not rotated


def test_a_bf16_model_computes_with_the_ops_what_torch_computes(tmp_path: Path) -> None:
    """A whole model (norms, rotary, MLP, residuals through the ops) gives the logits the torch
    operators give, at every position of a chunked prefill and its decode steps."""
    engine = make_engine(make_tiny_model(tmp_path / "tiny"), dtype="bfloat16")
    model = engine.model
    layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    assert layers[0].ops is not None, "the ops are in use for a bf16 Llama where they build"
    prompt = [random.Random(0).randrange(3, TINY_VOCAB) for _ in range(40)]
    chunks = [24, 13, 1, 1, 1]
    with_ops = engine_logits(engine, prompt, chunks)
    for layer in layers:
        layer.use_ops(None)
    model.norm.ops = None
    without = engine_logits(engine, prompt, chunks)
    assert with_ops.shape == without.shape == (len(prompt), TINY_VOCAB)
    assert torch.equal(with_ops.argmax(-1), without.argmax(-1))
    torch.testing.assert_close(with_ops, without, rtol=0, atol=2e-2 * without.abs().max().item())
