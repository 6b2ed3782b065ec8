"""Allocation of the paged KV cache tensors: one [num_blocks, 2, kv_heads, block_size, head_dim]
tensor per layer, sized from a memory budget and pre-faulted so the first requests do not pay
for touching fresh pages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.config import CacheConfig, ModelConfig

# The dimensions of each layer's cache tensor, in order: what a block's bytes mean. Peers that
# move KV between them must agree on it (the handshake compares it).
KV_LAYOUT = "blocks,kv,kv_heads,block_size,head_dim"


def layer_windows(model: ModelConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention)."""
    return tuple(model.layer_window(i) for i in range(model.num_layers))


def kv_layout(model: ModelConfig) -> str:
    """The cache's layout as peers compare it: the tensor's dimensions, and which layers hold
    only their sliding window's blocks (sent and kept)."""
    if not model.local_layers:
        return KV_LAYOUT
    return f"{KV_LAYOUT} window={model.sliding_window} on layers {list(model.local_layers)}"


class KVCacheSizeError(ValueError):
    pass


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return model.num_layers * 2 * model.num_kv_heads * block_size * model.head_dim * elem


def layer_block_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of one layer, every KV head (what a transfer frame moves per block)."""
    return bytes_per_block(model, block_size, dtype) // model.num_layers


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


@dataclass(frozen=True)
class KVShard:
    """One tensor-parallel rank's KV: KV heads [head_start, head_start + num_heads) of every
    layer, for the same block ids as every other rank (one shard holds all heads at TP=1)."""

    head_start: int
    caches: list[torch.Tensor]  # per layer [num_blocks, 2, num_heads, block_size, head_dim]

    @property
    def num_heads(self) -> int:
        return self.caches[0].shape[2]

    @property
    def end(self) -> int:
        return self.head_start + self.num_heads


def allocate_shared_kv_cache(
    model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """A rank's whole cache as one [layers, num_blocks, 2, kv_heads, block_size, head_dim]
    tensor in shared memory, pre-faulted: rank 0 allocates every rank's, so its transport can
    move any rank's heads, and hands each worker its own at spawn."""
    shape = (model.num_layers, num_blocks, 2, model.num_kv_heads, block_size, model.head_dim)
    cache = torch.empty(shape, dtype=dtype)
    cache.share_memory_()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    return cache.zero_()
