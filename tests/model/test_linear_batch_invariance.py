"""What --deterministic rests on: the compiled linears (csrc/bf16_linear.cpp, f32_linear.cpp)
give every row the same bits alone and in any batch, from one row to a prompt's hundreds (the
tiled path that takes 16 rows and more included), wherever the row sits in the batch, at every
instruction-set level this CPU executes (a level it cannot execute is skipped, saying why)."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.isa import Isa
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
