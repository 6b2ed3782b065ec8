"""bf16 weights multiplied in fp32 (`--bf16-matmul`, the default where a CPU emulates bf16
matmuls): each output is the exact product rounded to bf16, and SmolLM2's logits stay within
bf16's own distance from the fp32 model."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from pdserve.model.llama import Linear
from tests.helpers import engine_logits, make_engine


def ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 bits of mantissa)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


@pytest.mark.parametrize("rows", [1, 5, 6, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_wide_linear_is_the_exact_product_rounded_to_bf16(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(96, 40, bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=gen))
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(40, generator=gen))
    layer.to(torch.bfloat16)
    layer.pack(wide_rows=1)
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)

    out = layer(x)

    assert out.dtype == torch.bfloat16
    exact = x.double() @ layer.weight.double().T
    if layer.bias is not None:
        exact = exact + layer.bias.double()
    # Round-to-nearest: half a unit in the last place, plus the fp32 sums' own error.
    assert ((out.double() - exact).abs() <= 0.5 * ulp_bf16(exact) + 1e-5).all()


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
