"""bf16 linears where a CPU emulates bf16 matmuls (`--bf16-matmul auto`, the default there):
batches multiplied in fp32 and a few rows through the compiled kernel that reads each bf16
weight row once. Each output is the exact product rounded to bf16, and SmolLM2's logits stay
within bf16's own distance from the fp32 model."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from pdserve.model.fused import bf16_linear_kernel
from pdserve.model.llama import Linear
from tests.helpers import engine_logits, make_engine


def ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 bits of mantissa)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


def bf16_layer(rows: int, bias: bool, k: int = 100, n: int = 70) -> tuple[Linear, torch.Tensor]:
    """A bf16 layer (k inputs, a length that is not a multiple of a vector) and `rows` inputs."""
    gen = torch.Generator().manual_seed(rows * 2 + bias)
    layer = Linear(k, n, bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen))
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(n, generator=gen))
    layer.to(torch.bfloat16)
    return layer, torch.randn(rows, k, generator=gen).to(torch.bfloat16)


def assert_rounded_exact(out: torch.Tensor, layer: Linear, x: torch.Tensor) -> None:
    assert out.dtype == torch.bfloat16
    exact = x.double() @ layer.weight.double().T
    if layer.bias is not None:
        exact = exact + layer.bias.double()
    # Round-to-nearest: half a unit in the last place, plus the fp32 sums' own error.
    assert ((out.double() - exact).abs() <= 0.5 * ulp_bf16(exact) + 1e-5).all()


@pytest.mark.parametrize("rows", [1, 5, 6, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_wide_linear_is_the_exact_product_rounded_to_bf16(rows: int, bias: bool) -> None:
    layer, x = bf16_layer(rows, bias)
    layer.pack(wide_rows=1)
    assert_rounded_exact(layer(x), layer, x)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 11])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_kernel_is_the_exact_product_rounded_to_bf16(rows: int, bias: bool) -> None:
    kernel = bf16_linear_kernel()
    assert kernel is not None, "the CPU kernels did not build (g++ and ninja are needed)"
    layer, x = bf16_layer(rows, bias)
    assert_rounded_exact(kernel(x, layer.weight, layer.bias), layer, x)


@pytest.mark.parametrize("rows", [1, 3, 11, 12, 40])
def test_a_layer_with_both_weights_is_exact_on_either_side_of_the_threshold(rows: int) -> None:
    """As `--bf16-matmul auto` packs a layer where bf16 is emulated: fewer than 12 rows through
    the kernel (one row through torch), 12 or more in fp32."""
    layer, x = bf16_layer(rows, bias=True)
    layer.pack(wide_rows=12)
    assert layer.narrow is not None
    assert_rounded_exact(layer(x), layer, x)


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
