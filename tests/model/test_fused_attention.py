"""The compiled decode attention (and the torch fallback) against a reference written from the
definition: each sequence's keys and values gathered position by position from its block
table, softmax(q k^T / sqrt(d)) v in float64. Block sizes, GQA groups, lengths that are not a
multiple of the block size, scattered blocks; float32 and bfloat16."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.model_runner import _decode_batch
from pdserve.model.attention import _decode_attention
from pdserve.model.fused import paged_decode_kernel


def reference(
    q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], lengths: list[int]
) -> torch.Tensor:
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, block = cache.shape[2], cache.shape[3]
    group = heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for s, (table, length) in enumerate(zip(tables, lengths, strict=True)):
        for h in range(heads):
            kh = h // group
            keys = torch.stack([cache[table[p // block], 0, kh, p % block] for p in range(length)])
            values = torch.stack(
                [cache[table[p // block], 1, kh, p % block] for p in range(length)]
            )
            scores = keys.double() @ q[s, h].double() / dim**0.5
            out[s, h] = torch.softmax(scores, dim=0) @ values.double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "block,heads,kv_heads,dim", [(16, 9, 3, 64), (8, 4, 4, 32), (32, 8, 2, 16), (1, 2, 1, 8)]
)
@pytest.mark.parametrize("backend", ["fused", "torch"])
def test_decode_attention_matches_the_definition(
    dtype: torch.dtype, block: int, heads: int, kv_heads: int, dim: int, backend: str
) -> None:
    kernel = paged_decode_kernel()
    assert kernel is not None, "the CPU kernel did not build (g++ and ninja are needed)"
    rng = random.Random(block * 100 + heads)
    torch.manual_seed(block)
    num_blocks = 96
    cache = torch.randn(num_blocks, 2, kv_heads, block, dim).to(dtype)
    lengths = [1, block, block + 1, 3 * block - 1, rng.randint(1, 40)]
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered, not consecutive
    tables = []
    for length in lengths:
        n = -(-length // block)
        tables.append([free.pop() for _ in range(n)])
    q = torch.randn(len(lengths), heads, dim).to(dtype)
    batch = _decode_batch(
        list(range(len(lengths))),
        tables,
        lengths,
        block,
        kernel if backend == "fused" else None,
    )
    assert batch is not None
    got = _decode_attention(q, cache, batch).double()
    want = reference(q, cache, tables, lengths)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()
