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


DTYPES = [torch.bfloat16, torch.float32]


def rows(
    shape: tuple[int, ...], seed: int, scale: float = 3.0, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def assert_norm_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal but for a rare single bf16 step (the order of the sum of squares); in float32
    within a few ulps (the same order, no rounding to hide it)."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=4e-7, atol=1e-6)
        return
    diff = (out.float() - ref.float()).abs()
    assert (diff <= ulp_bf16(ref.float())).all()
    assert (out != ref).float().mean() < 1e-3


def torch_norm(weight: torch.Tensor) -> RMSNorm:
    norm = RMSNorm(weight.numel(), 1e-5).to(weight.dtype)
    norm.weight.data.copy_(weight)
    return norm  # its ops are unset: torch's operators


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name.lower())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norms_and_adds_match_torch(level: Isa, shape: tuple[int, int], dtype: torch.dtype) -> None:
    ops = level_kernels(level)
    x, y = rows(shape, 1, dtype=dtype), rows(shape, 2, dtype=dtype)
    weight = rows((shape[1],), 3, 1.0, dtype)
    ref = torch_norm(weight)
    assert_norm_close(ops.rms_norm(x, weight, 1e-5), ref(x))
    total, normed = ops.add_rms_norm(x, y, weight, 1e-5)
    assert torch.equal(total, x + y)
    assert_norm_close(normed, ref(x + y))
    assert torch.equal(ops.add_rows(x, y), x + y)


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name.lower())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_torch(level: Isa, shape: tuple[int, int], dtype: torch.dtype) -> None:
    """bf16: torch's bits. float32: within an ulp or two (a level's exp may differ from the
    one torch dispatches to on this host in the last bit, which bf16's rounding hides)."""
    ops = level_kernels(level)
    gate_up = rows((shape[0], 2 * shape[1]), 4, dtype=dtype)
    gate, up = gate_up.split(shape[1], dim=-1)
    if dtype == torch.bfloat16:
        assert torch.equal(ops.silu_mul(gate_up), F.silu(gate) * up)
    else:
        torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=4e-7, atol=1e-7)


def every_bf16() -> torch.Tensor:
    """The 65,536 bf16 bit patterns (denormals, infinities and NaNs among them), as 256 x 256."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.bfloat16).view(256, 256)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit, but NaN only where torch's is NaN (a NaN's payload is not kept)."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name.lower())
def test_silu_mul_gives_torchs_bits_for_every_bf16_gate(level: Isa) -> None:
    """Every one of the 65,536 bf16 gate values (infinities too), through a prompt's rows (256:
    the looked-up activation) and a decode step's (64 at a time: the formula), times an up of 1
    (exact): F.silu's bits, and NaN where it is NaN (a NaN's payload is not kept alike)."""
    ops = level_kernels(level)
    gate = every_bf16()
    gate_up = torch.cat([gate, torch.ones_like(gate)], dim=1)
    want = F.silu(gate)
    assert 0 < want.isnan().sum() < 300  # the NaN patterns only
    assert_same_bits(ops.silu_mul(gate_up), want)
    for first in range(0, 256, 64):
        rows = slice(first, first + 64)
        assert_same_bits(ops.silu_mul(gate_up[rows].contiguous()), want[rows])


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name.lower())
def test_denormals_survive_the_rounding_to_bf16(level: Isa) -> None:
    """Sums and rotations whose results are denormal (or ties, or overflow) come out as torch's:
    AVX512-BF16's conversion, which the ops use to round, flushes denormals to zero, and the ops
    must not. Every bf16 value as an operand, with a fixed shuffle of them as the other."""
    ops = level_kernels(level)
    x = every_bf16()
    perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(8))
    y = x.flatten()[perm].view(x.shape)
    assert (x.float().abs() < torch.finfo(torch.bfloat16).tiny).sum() > 200  # denormals in it
    assert_same_bits(ops.add_rows(x, y), x + y)
    cos, sin = y[:, :64].contiguous(), y[:, 64:128].contiguous()
    qkv = x.clone()  # 4 heads of 64
    ops.rotary_(qkv, 4, 64, cos, sin)
    assert_same_bits(qkv.view(256, 4, 64), apply_rotary(x.view(256, 4, 64), cos, sin))


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name.lower())
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "dim"), [(1, 9, 3, 64), (37, 4, 2, 20)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_in_place_matches_torch(
    level: Isa, tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> None:
    ops = level_kernels(level)
    qkv = rows((tokens, (heads + 2 * kv_heads) * dim), 5, 1.0, dtype)
    cos, sin = rows((tokens, dim), 6, 1.0, dtype), rows((tokens, dim), 7, 1.0, dtype)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    want_q = apply_rotary(q.reshape(tokens, heads, dim), cos, sin)
    want_k = apply_rotary(k.reshape(tokens, kv_heads, dim), cos, sin)
    want_v = v.clone()
    ops.rotary_(qkv, heads + kv_heads, dim, cos, sin)  # q and k are views of qkv
    assert torch.equal(q.reshape(tokens, heads, dim), want_q)
    assert torch.equal(k.reshape(tokens, kv_heads, dim), want_k)
    assert torch.equal(v, want_v)  # v's heads are not rotated


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_model_computes_with_the_ops_what_torch_computes(tmp_path: Path, dtype: str) -> None:
    """A whole model (norms, rotary, MLP, residuals through the ops) gives the logits the torch
    operators give, at every position of a chunked prefill and its decode steps."""
    engine = make_engine(make_tiny_model(tmp_path / "tiny"), dtype=dtype)
    model = engine.model
    layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    assert layers[0].ops is not None, "the ops are in use for a Llama where they build"
    prompt = [random.Random(0).randrange(3, TINY_VOCAB) for _ in range(40)]
    chunks = [24, 13, 1, 1, 1]
    with_ops = engine_logits(engine, prompt, chunks)
    for layer in layers:
        layer.use_ops(None)
    model.norm.ops = None
    without = engine_logits(engine, prompt, chunks)
    assert with_ops.shape == without.shape == (len(prompt), TINY_VOCAB)
    assert torch.equal(with_ops.argmax(-1), without.argmax(-1))
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    torch.testing.assert_close(with_ops, without, rtol=0, atol=tol * without.abs().max().item())
