"""Registered KV memory as bytes: per layer (and per tensor-parallel rank) a view of the cache
tensor, and the views of a block list (one per run of consecutive ids, or a head slice of each
block) that the transports send from and receive into without a copy."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from pdserve.engine.kv_cache import KVShard


class KVRegions:
    """Registered KV memory: per layer a byte view [num_blocks, block_bytes] of the cache tensor
    (each block one contiguous range, DESIGN.md §5). No copies: views of the live tensors.

    A tensor-parallel node registers every rank's shard (rank 0 shares their memory): a frame
    carries heads [head_start, head_start + head_count) of one layer, which lie within one
    shard, K then V per block. `frame_heads` splits the heads where either side's shards do,
    so each head crosses the wire once and every frame lands within one receiving shard."""

    def __init__(self, caches: list[torch.Tensor], shards: list[KVShard] | None = None) -> None:
        self.shards = shards if shards is not None else [KVShard(0, caches)]
        caches = self.shards[0].caches
        self.layers: list[np.ndarray] = [
            c.view(torch.uint8).reshape(c.shape[0], -1).numpy() for c in caches
        ]
        self.num_layers = len(caches)
        self.num_blocks = caches[0].shape[0] if caches else 0
        self.num_kv_heads = max((s.head_start + s.num_heads for s in self.shards), default=0)
        # K and V of one head in one block; a block of all heads is `block_bytes`.
        self.head_bytes = (self.layers[0].shape[1] // self.shards[0].num_heads) if caches else 0
        self.block_bytes = self.head_bytes * self.num_kv_heads
        self.bounds = sorted({b for s in self.shards for b in (s.head_start, s.end)})
        # One flat byte view per (shard, layer); a block range is a cheap slice of it.
        self._flat = [[_bytes_of(c) for c in s.caches] for s in self.shards]

    @classmethod
    def sharded(cls, shards: list[KVShard]) -> KVRegions:
        return cls(shards[0].caches, shards)

    def holders(self, head_start: int, head_count: int) -> list[int]:
        """The shards holding heads [head_start, +head_count) whole (several where ranks
        replicate them)."""
        end = head_start + head_count
        return [i for i, s in enumerate(self.shards) if s.head_start <= head_start and end <= s.end]

    def holder(self, head_start: int, head_count: int) -> int | None:
        """The first shard holding heads [head_start, +head_count) whole, or None."""
        found = self.holders(head_start, head_count)
        return found[0] if found else None

    def frame_heads(self, peer_bounds: list[int]) -> list[tuple[int, int]]:
        """(head_start, head_count) per frame of a layer sent to a peer whose shards split the
        heads at `peer_bounds` (e.g. [0, 2, 4]): split wherever either side's shards split."""
        cuts = sorted(set(self.bounds) | set(peer_bounds))
        return [(a, b - a) for a, b in zip(cuts, cuts[1:], strict=False)]

    def views(
        self, layer: int, blocks: list[int], head_start: int = 0, head_count: int = 0
    ) -> list[memoryview]:
        """Byte views covering heads [head_start, +head_count) (0: all) of `blocks` in order,
        K then V per block, in the first shard holding them: one view per run of consecutive
        block ids when the frame is the shard's every head, else two per block."""
        return self.layers_views([layer], blocks, head_start, head_count)

    def layers_views(
        self, layers: Iterable[int], blocks: list[int], head_start: int = 0, head_count: int = 0
    ) -> list[memoryview]:
        """`views` of each of `layers` in turn (a frame of several layers), the block runs and
        offsets worked out once. IndexError for a layer out of range."""
        return list(self.stream_views(layers, blocks, head_start, head_count))

    def stream_views(
        self, layers: Iterable[int], blocks: list[int], head_start: int = 0, head_count: int = 0
    ) -> Iterator[memoryview]:
        """`layers_views`, each layer's views made only as the one reading them gets there:
        a socket starts on a frame's first layer at once instead of after thousands of views
        (a 2,048-token frame of scattered blocks: 3,840 views, ~1 ms of Python on cold caches
        on either side before its first byte). Heads and layers are checked here, at once:
        ValueError for heads no shard holds, IndexError for a layer out of range."""
        head_count = head_count or self.num_kv_heads
        index = self.holder(head_start, head_count)
        if index is None:
            raise ValueError(f"no shard holds heads [{head_start}, +{head_count})")
        shard, flats = self.shards[index], self._flat[index]
        layers = list(layers)
        if not all(0 <= layer < len(flats) for layer in layers):
            raise IndexError(f"layers {layers[:4]} out of range [0, {len(flats)})")
        size = self.head_bytes * shard.num_heads
        if head_count == shard.num_heads:
            spans = [(start * size, (start + n) * size) for start, n in runs(blocks)]
        else:
            half = self.head_bytes // 2  # K (or V) of one head in one block
            k = (head_start - shard.head_start) * half
            v = k + shard.num_heads * half
            width = head_count * half
            spans = []
            for b in blocks:
                base = b * size
                spans += ((base + k, base + k + width), (base + v, base + v + width))
        # a layer's views by one comprehension, the layers chained as they are reached
        per_layer = ([flat[a:z] for a, z in spans] for flat in map(flats.__getitem__, layers))
        return itertools.chain.from_iterable(per_layer)

    def mirror(self, layer: int, blocks: list[int], head_start: int, head_count: int) -> None:
        """Copy heads just written into their first holder to every other shard that holds
        them too (ranks replicating KV heads when there are fewer heads than ranks)."""
        first, *replicas = self.holders(head_start, head_count)
        if not replicas:  # the common case: nothing to copy
            return
        src = self.shards[first]
        index = torch.tensor(blocks, dtype=torch.long)
        lo = head_start - src.head_start
        heads = src.caches[layer][index, :, lo : lo + head_count]
        for i in replicas:
            at = head_start - self.shards[i].head_start
            self.shards[i].caches[layer][index, :, at : at + head_count] = heads

    def clear_tail(self, block: int, first_slot: int) -> None:
        """Zero token slots [first_slot, block_size) of `block` in every layer of every shard
        (the cache layout is [blocks, K/V, kv heads, slots, head dim])."""
        for shard in self.shards:
            for cache in shard.caches:
                cache[block, :, :, first_slot:, :].zero_()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous tensor's memory."""
    return memoryview(tensor.view(torch.uint8).reshape(-1).numpy()).cast("B")  # type: ignore[arg-type]  # numpy's buffer, typed narrowly


def runs(blocks: list[int]) -> list[tuple[int, int]]:
    """[(first, count)] for runs of consecutive ids: 3,4,5,9 -> (3,3),(9,1)."""
    return [(first, count) for first, _, count in pair_runs(blocks, blocks)]


def pair_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """[(src first, dst first, count)] for runs where both ids are consecutive. (A frame's
    hot path: one comparison per block, a tuple per run.)"""
    out: list[tuple[int, int, int]] = []
    if not src:
        return out
    s0, d0, n = src[0], dst[0], 1
    for s, d in zip(src[1:], dst[1:], strict=True):
        if s == s0 + n and d == d0 + n:
            n += 1
            continue
        out.append((s0, d0, n))
        s0, d0, n = s, d, 1
    out.append((s0, d0, n))
    return out
