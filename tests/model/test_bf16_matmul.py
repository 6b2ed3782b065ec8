"""bf16 linears where a CPU emulates bf16 matmuls (`--bf16-matmul auto`, the default there):
batches multiplied in fp32 and a few rows through the compiled kernel that reads each bf16
weight row once. Each output is the exact product rounded to bf16 (SmolLM2's logits in this
mode are checked in test_logits.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.fused import bf16_linear_kernel
from pdserve.model.llama import Linear


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
