"""bf16 linears as `--bf16-matmul auto` packs them on this host's instruction set (isa.py):
on AVX2 and AVX512-BF16 builds every row of a layer of whole 64-feature panels through the
panel kernel; other layers, where bf16 is emulated, batches multiplied in fp32 and a few rows
through the compiled kernel that reads each bf16 weight row once, and where the CPU has native
bf16 a few rows through the kernel's vdpbf16ps path and batches through oneDNN (as every layer
on AMX). Each output is the
exact product rounded to bf16 (SmolLM2's logits in these modes are checked in test_logits.py).
The kernel is checked at every instruction-set level this CPU executes; a level it cannot
execute is skipped, saying why."""

from __future__ import annotations

import copy

import pytest
import torch

from pdserve.model.fused import compiled
from pdserve.model.isa import Isa, chosen_isa, host_isa, missing
from pdserve.model.linear import (
    AMX_NARROW_ROWS,
    NATIVE_NARROW_ROWS,
    WIDE_ROWS,
    Linear,
    linear_plan,
)


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


def level_kernels(level: Isa):  # type: ignore[no-untyped-def]
    if level > host_isa():
        pytest.skip(f"this CPU cannot execute {level.name.lower()} code: no {missing(level)}")
    module = compiled(level)
    assert module is not None, "the CPU kernels did not build (g++ and ninja are needed)"
    return module


@pytest.mark.parametrize("rows", [1, 5, 6, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_wide_linear_is_the_exact_product_rounded_to_bf16(rows: int, bias: bool) -> None:
    layer, x = bf16_layer(rows, bias)
    layer.pack(plan=linear_plan(torch.bfloat16, "fp32"))
    assert layer.wide is not None
    assert_rounded_exact(layer(x), layer, x)


@pytest.mark.parametrize("level", [Isa.GENERIC, Isa.AVX2, Isa.AVX512])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 11])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [100, 576])  # a tail shorter than a vector; whole vectors
def test_bf16_linear_kernel_is_the_exact_product_rounded_to_bf16(
    level: Isa, rows: int, bias: bool, k: int
) -> None:
    kernel = level_kernels(level).bf16_linear
    layer, x = bf16_layer(rows, bias, k=k)
    assert_rounded_exact(kernel(x, layer.weight, layer.bias), layer, x)


def test_auto_takes_the_path_this_host_should() -> None:
    """Native bf16 (as oneDNN reports it, independently of isa.py): no fp32 copy of the weights,
    a few rows through the kernel (one on AMX); emulated: batches in fp32."""
    plan = linear_plan(torch.bfloat16, "auto")
    assert plan is not None and plan.kernel is not None
    assert (plan.blocked is not None) == (chosen_isa() in (Isa.AVX2, Isa.AVX512))
    if chosen_isa() == Isa.AMX:  # oneDNN's tiles from two rows
        assert plan.wide_rows is None and plan.narrow_rows == AMX_NARROW_ROWS
    elif chosen_isa().native_bf16:
        assert plan.wide_rows is None and plan.narrow_rows == NATIVE_NARROW_ROWS
    else:
        assert plan.wide_rows == WIDE_ROWS and plan.narrow_rows == WIDE_ROWS
    if chosen_isa() == host_isa():  # not forced lower: oneDNN agrees on what the CPU has
        onednn_native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        assert chosen_isa().native_bf16 == onednn_native


@pytest.mark.parametrize("rows", [1, 3, 7, 8, 11, 12, 40])
def test_a_layer_is_exact_on_either_side_of_the_thresholds(rows: int) -> None:
    """As `--bf16-matmul auto` packs a layer on this host (see the test above)."""
    layer, x = bf16_layer(rows, bias=True)
    layer.pack(plan=linear_plan(torch.bfloat16, "auto"))
    assert layer.narrow is not None
    assert_rounded_exact(layer(x), layer, x)


@pytest.mark.parametrize("rows", [1, 7, 8, 40])
def test_a_layer_of_whole_panels_takes_them_on_avx2_and_avx512_and_is_exact(rows: int) -> None:
    layer, x = bf16_layer(rows, bias=True, n=128)
    reference = copy.deepcopy(layer)  # packing into panels drops the layer's plain weight
    layer.pack(plan=linear_plan(torch.bfloat16, "auto"))
    assert (layer.blocked is not None) == (chosen_isa() in (Isa.AVX2, Isa.AVX512))
    if layer.blocked is not None:
        assert layer.wide is None  # no float32 copy of a layer in panels
    assert_rounded_exact(layer(x), reference, x)
