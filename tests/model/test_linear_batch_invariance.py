"""What --deterministic rests on: the compiled linears (csrc/bf16_linear.cpp, f32_linear.cpp)
give every row the same bits alone and in any batch, from one row to a prompt's hundreds (the
tiled path that takes 16 rows and more included), wherever the row sits in the batch, at every
instruction-set level this CPU executes (a level it cannot execute is skipped, saying why); the
same for the panel kernels the layers take (AVX2 and AVX512 builds), which in float32 give the
same bits at either level."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.model.fused import amx_linear_kernel
from pdserve.model.isa import Isa, chosen_isa
from pdserve.model.linear import Linear, amx_tiles, block_weight, linear_plan
from pdserve.model.loader import load_model
from tests.helpers import make_tiny_model
from tests.model.test_bf16_matmul import level_kernels

LEVELS = [Isa.GENERIC, Isa.AVX2, Isa.AVX512]
BATCHES = [2, 3, 4, 5, 8, 15, 16, 17, 31, 64, 100]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("k", [100, 576])  # a tail shorter than a vector; whole vectors
def test_a_row_is_the_same_bits_alone_and_in_any_batch(
    level: Isa, dtype: torch.dtype, k: int
) -> None:
    module = level_kernels(level)
    kernel = module.bf16_linear if dtype == torch.bfloat16 else module.f32_linear
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(max(BATCHES), k, generator=gen).to(dtype)
    w = (torch.randn(37, k, generator=gen) * 0.1).to(dtype)  # odd: a weight row left over
    b = torch.randn(37, generator=gen).to(dtype)
    alone = torch.cat([kernel(x[i : i + 1], w, b) for i in range(x.shape[0])])
    for rows in BATCHES:
        for start in (0, 1, x.shape[0] - rows):  # the rows at other places in the tiles
            batch = kernel(x[start : start + rows].contiguous(), w, b)
            assert torch.equal(batch, alone[start : start + rows]), (rows, start)


# tiles of 6 rows, work items of 48; from 24 rows AVX2 builds take bf16 through float32 panels
# (widened per thread), which must give the bits of the bf16 tiles that fewer rows take
PANEL_BATCHES = [1, 2, 5, 6, 7, 13, 23, 24, 47, 48, 49, 100]


DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


PANEL_LEVELS = pytest.mark.parametrize("level", [Isa.AVX2, Isa.AVX512])


def panel_kernel(dtype: torch.dtype, level: Isa):  # type: ignore[no-untyped-def]
    module = level_kernels(level)
    return module.bf16_blocked_linear if dtype == torch.bfloat16 else module.f32_blocked_linear


@PANEL_LEVELS
@DTYPES
@pytest.mark.parametrize("k", [64, 576])
def test_panel_kernel_gives_a_row_the_same_bits_alone_and_in_any_batch(
    level: Isa, dtype: torch.dtype, k: int
) -> None:
    kernel = panel_kernel(dtype, level)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(max(PANEL_BATCHES), k, generator=gen).to(dtype)
    w = block_weight((torch.randn(192, k, generator=gen) * 0.1).to(dtype))  # three panels
    b = torch.randn(192, generator=gen).to(dtype)
    alone = torch.cat([kernel(x[i : i + 1], w, b) for i in range(x.shape[0])])
    for rows in PANEL_BATCHES:
        for start in (0, 1, x.shape[0] - rows):
            batch = kernel(x[start : start + rows].contiguous(), w, b)
            assert torch.equal(batch, alone[start : start + rows]), (rows, start)


@PANEL_LEVELS
@DTYPES
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "rows", [13, 100]
)  # a decode batch's tiles; a prompt's (AVX2 bf16: widened)
def test_panel_kernel_is_the_product_within_float32_sums_and_one_rounding(
    level: Isa, dtype: torch.dtype, bias: bool, rows: int
) -> None:
    kernel = panel_kernel(dtype, level)
    gen = torch.Generator().manual_seed(7)
    k = 576
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = (torch.randn(128, k, generator=gen) * 0.1).to(dtype)
    b = torch.randn(128, generator=gen).to(dtype) if bias else None
    exact = x.double() @ weight.double().T + (0 if b is None else b.double())
    got = kernel(x, block_weight(weight), b).double()
    # float32 sums of k products (each bf16 x bf16 product is exact in float32; fp32 FMAs round
    # once each), then one rounding to the dtype: a misplaced weight or feature would be off by
    # whole products
    magnitude = x.double().abs() @ weight.double().abs().T
    output_rounding = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    bound = (k + 1) * 2.0**-24 * magnitude + output_rounding * exact.abs() + 1e-30
    assert ((got - exact).abs() <= bound).all()


def test_float32_panels_are_the_same_bits_on_avx2_and_avx512() -> None:
    """Both tiles run one FMA chain per output over the inputs in order, whatever the vector
    width, so a float32 model's output does not depend on which of the two builds a host took."""
    avx2, avx512 = panel_kernel(torch.float32, Isa.AVX2), panel_kernel(torch.float32, Isa.AVX512)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(13, 576, generator=gen)
    w = block_weight(torch.randn(192, 576, generator=gen) * 0.1)
    b = torch.randn(192, generator=gen)
    for rows in (1, 2, 4, 13):
        assert torch.equal(avx2(x[:rows], w, b), avx512(x[:rows], w, b)), rows


@DTYPES
def test_the_layers_take_the_panels_where_the_shape_allows(dtype: torch.dtype) -> None:
    """By default and under --deterministic alike, on the AVX2 and AVX512 builds; on AMX
    hosts bf16 batches go through oneDNN's tiles by default (linear.py) and under --deterministic
    through the AMX tiles' own kernel, weights in its layout (float32 takes the panels always)."""
    if chosen_isa() < Isa.AVX2:
        pytest.skip(
            "the panels are the AVX2 and AVX512 builds' (this host or PDSERVE_ISA has none)"
        )
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 64, generator=gen).to(dtype)
    for deterministic in (False, True):
        plan = linear_plan(dtype, "auto", deterministic=deterministic)
        assert plan is not None and plan.kernel is not None
        tiles = chosen_isa() == Isa.AMX and dtype == torch.bfloat16 and not deterministic
        assert (plan.blocked is None) == tiles
        if tiles:
            continue
        assert plan.blocked is not None
        for features in (128, 40):  # 40: not whole panels, so the row kernel
            weight = (torch.randn(features, 64, generator=gen) * 0.1).to(dtype)
            bias = torch.randn(features, generator=gen).to(dtype)
            layer = Linear(64, features, bias=True)
            layer.weight.data, layer.bias.data = weight.clone(), bias.clone()  # type: ignore[union-attr]
            layer.pack(plan=plan)
            # --deterministic on AMX: the tiles' layout (40 is not whole tiles either)
            panels = (amx_tiles if plan.tiles else block_weight)(weight)
            assert (layer.blocked is not None) == (panels is not None) == (features == 128)
            if panels is not None:
                expect = plan.blocked(x, panels, bias)
            else:
                expect = plan.kernel(x, weight, bias)
            assert torch.equal(layer(x), expect)


def amx_kernel():  # type: ignore[no-untyped-def]
    """The AMX tiles' linear (--deterministic's layers on AMX hosts), where this CPU has them."""
    module = level_kernels(Isa.AMX)  # skips, saying why, where the CPU has no AMX
    if not module.amx_ready():
        pytest.skip("Linux gives this process no AMX tile state")
    return module.amx_linear


AMX_BATCHES = [1, 2, 15, 16, 17, 31, 32, 33, 64, 65, 100]  # around tiles (16) and row blocks (32)


@pytest.mark.parametrize("k", [64, 576])
def test_amx_tiles_give_a_row_the_same_bits_alone_and_in_any_batch(k: int) -> None:
    kernel = amx_kernel()
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(max(AMX_BATCHES), k, generator=gen).to(torch.bfloat16)
    # 288 features: more than one group of 256 a thread's rows pass over at a time
    w = amx_tiles((torch.randn(288, k, generator=gen) * 0.1).to(torch.bfloat16))
    b = torch.randn(288, generator=gen).to(torch.bfloat16)
    alone = torch.cat([kernel(x[i : i + 1], w, b) for i in range(x.shape[0])])
    for rows in AMX_BATCHES:
        for start in (0, 1, x.shape[0] - rows):
            batch = kernel(x[start : start + rows].contiguous(), w, b)
            assert torch.equal(batch, alone[start : start + rows]), (rows, start)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 45])
def test_amx_tiles_are_the_product_within_float32_sums_and_one_rounding(
    bias: bool, rows: int
) -> None:
    kernel = amx_kernel()
    gen = torch.Generator().manual_seed(rows + bias)
    k = 576
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(96, k, generator=gen) * 0.1).to(torch.bfloat16)
    b = torch.randn(96, generator=gen).to(torch.bfloat16) if bias else None
    exact = x.double() @ weight.double().T + (0 if b is None else b.double())
    got = kernel(x, amx_tiles(weight), b).double()
    # as the panels' bound (above): a misplaced weight, input pair or feature is off by whole
    # products
    magnitude = x.double().abs() @ weight.double().abs().T
    bound = (k + 1) * 2.0**-24 * magnitude + 2.0**-8 * exact.abs() + 1e-30
    assert ((got - exact).abs() <= bound).all()


def test_deterministic_layers_take_the_amx_tiles_on_amx_hosts() -> None:
    """What this host should choose: on AMX the tiles (each row its own sums, as the panels),
    on AVX2 and AVX512 builds the panels, on a generic one (forced) the row kernel; and a layer
    packed so gives a row the same bits alone and batched."""
    plan = linear_plan(torch.bfloat16, "auto", deterministic=True)
    assert plan is not None
    expect_tiles = chosen_isa() == Isa.AMX and amx_linear_kernel() is not None
    assert plan.tiles == expect_tiles
    expect_blocked = expect_tiles or chosen_isa() in (Isa.AVX2, Isa.AVX512)
    gen = torch.Generator().manual_seed(3)
    layer = Linear(576, 192, bias=True)
    layer.weight.data = (torch.randn(192, 576, generator=gen) * 0.1).to(torch.bfloat16)
    layer.bias.data = torch.randn(192, generator=gen).to(torch.bfloat16)  # type: ignore[union-attr]
    x = torch.randn(40, 576, generator=gen).to(torch.bfloat16)
    layer.pack(plan=plan)
    assert (layer.blocked is not None) == expect_blocked
    if layer.blocked is not None:
        assert layer.blocked.dim() == (6 if expect_tiles else 4)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
    assert torch.equal(layer(x), alone)


def test_deterministic_head_takes_the_tiles_where_the_layers_do(tmp_path: Path) -> None:
    """--deterministic in bf16: the output projection (tied to the embedding here) multiplies on
    the AMX tiles where the layers do (this host: AMX with the tile state), elsewhere through the
    row kernel; either way a row's logits are the same bits alone and in a batch, and the
    embedding keeps its weight."""
    model_dir = make_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    model = load_model(model_dir, "bfloat16", deterministic=True)
    head = model.lm_head
    plan = linear_plan(torch.bfloat16, "auto", deterministic=True)
    assert plan is not None
    if plan.tiles:
        assert head.blocked is not None and head.blocked.dim() == 6
    else:
        assert head.blocked is None and head.narrow is plan.kernel
    table = model.embed_tokens.weight
    assert table.shape == (256, 64)
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(21, 64, generator=gen).to(torch.bfloat16)
    alone = torch.cat([head(hidden[i : i + 1]) for i in range(21)])
    assert torch.equal(head(hidden), alone)
    want = hidden.double() @ table.double().T  # the product, within bf16's rounding of it
    assert (head(hidden).double() - want).abs().max() <= 0.02 * want.abs().max()
