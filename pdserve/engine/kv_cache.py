"""Allocation of the paged KV cache tensors: one [num_blocks, 2, kv_heads, block_size, head_dim]
tensor per layer, sized from a memory budget and pre-faulted so the first requests do not pay
for touching fresh pages."""

from __future__ import annotations

import torch

from pdserve.config import CacheConfig, ModelConfig


class KVCacheSizeError(ValueError):
    pass


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return model.num_layers * 2 * model.num_kv_heads * block_size * model.head_dim * elem


def num_blocks_for(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = bytes_per_block(model, cache.block_size, dtype)
    n = cache.kv_cache_memory // per_block
    if n < 1:
        raise KVCacheSizeError(
            f"--kv-cache-memory {cache.kv_cache_memory} B is below one block ({per_block} B)"
        )
    return int(n)


def allocate_kv_cache(
    model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    shape = (num_blocks, 2, model.num_kv_heads, block_size, model.head_dim)
    # empty + zero_ writes every page now (torch.zeros may map lazily-zeroed pages).
    return [torch.empty(shape, dtype=dtype).zero_() for _ in range(model.num_layers)]
