"""float32 linears of a few rows through the compiled kernel (csrc/f32_linear.cpp), at every
instruction-set level this CPU executes (a level it cannot execute is skipped, saying why):
within float32's rounding of the exact product, and each row's output the same bits alone as in
any batch the kernel takes, which is what keeps fp32 decode steps independent of the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model.isa import Isa
from pdserve.model.linear import F32_NARROW_ROWS, Linear, linear_plan
from tests.model.test_bf16_matmul import level_kernels

LEVELS = [Isa.GENERIC, Isa.AVX2, Isa.AVX512]


def f32_case(rows: int, k: int, n: int = 70, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed * 1000 + rows * 7 + k)
    return (
        torch.randn(rows, k, generator=gen),
        torch.randn(n, k, generator=gen),
        torch.randn(n, generator=gen),
    )


def assert_close_to_exact(
    out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> None:
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    # a float32 sum of k products: each term and partial sum rounded, |error| <= k * 2^-23 * sum|.|
    bound = (x.double().abs() @ w.double().abs().T) * x.shape[1] * 2.0**-23 + 1e-6
    assert out.dtype == torch.float32
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 15])
@pytest.mark.parametrize("k", [100, 576])  # a tail shorter than 16 lanes; whole lanes
@pytest.mark.parametrize("bias", [False, True])
def test_f32_kernel_is_the_product_within_rounding(
    level: Isa, rows: int, k: int, bias: bool
) -> None:
    kernel = level_kernels(level).f32_linear
    x, w, b = f32_case(rows, k)
    assert_close_to_exact(kernel(x, w, b if bias else None), x, w, b if bias else None)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("k", [100, 576, 1536])
def test_a_row_is_the_same_bits_alone_and_in_any_batch(level: Isa, k: int) -> None:
    kernel = level_kernels(level).f32_linear
    x, w, b = f32_case(F32_NARROW_ROWS - 1, k, n=200)
    alone = torch.cat([kernel(x[i : i + 1], w, b) for i in range(x.shape[0])])
    for rows in range(2, x.shape[0] + 1):
        for start in (0, x.shape[0] - rows):  # the row at every place in a group of four
            batch = kernel(x[start : start + rows], w, b)
            assert torch.equal(batch, alone[start : start + rows]), (rows, start)


@pytest.mark.parametrize("rows", [1, 4, F32_NARROW_ROWS - 1, F32_NARROW_ROWS, 40])
def test_a_float32_layer_takes_the_kernel_for_few_rows_and_torch_beyond(rows: int) -> None:
    x, w, b = f32_case(rows, 576, seed=1)
    layer = Linear(576, w.shape[0], bias=True)
    with torch.no_grad():
        layer.weight.copy_(w)
        assert layer.bias is not None
        layer.bias.copy_(b)
    plan = linear_plan(torch.float32, "auto")
    assert plan is not None and plan.kernel is not None and plan.narrow_rows == F32_NARROW_ROWS
    layer.pack(plan=plan)
    with torch.no_grad():
        out = layer(x)
    if rows < F32_NARROW_ROWS:
        assert torch.equal(out, plan.kernel(x, w, b))
    else:
        assert torch.equal(out, F.linear(x, w, b))
    assert_close_to_exact(out, x, w, b)
