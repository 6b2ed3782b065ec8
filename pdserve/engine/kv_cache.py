"""Allocation of the paged KV cache tensors: one [num_blocks, 2, kv_heads, block_size, head_dim]
tensor per layer, sized from a memory budget and pre-faulted so the first requests do not pay
for touching fresh pages.

Models with sliding-window layers: a block's memory in those layers (its *window part*) is
needed only while some request's window reads it, and most blocks of a long context are
behind every window. The block pool holds at most `window_blocks` window parts at once
(`engine/block_pool.py`); the windowed layers' tensors keep every block's address (so a block
id means the same memory in every layer, for the kernels and the transfer plane alike) but
only the parts held are backed by memory: a part given back has its pages returned to the
system (`madvise`, `WindowMemory`) and they read as zeros when touched again. A budget then
buys more blocks: a block costs its full-attention layers plus a `WINDOW_SHARE` of its
windowed ones."""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass

import torch

from pdserve.config import CacheConfig, ModelConfig
from pdserve.model.hugepages import huge_page_buffer, small_page_buffer

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


# Budget-sized caches of models with windowed layers: window parts for this share of the
# blocks. A request holds a part per block of its window (Gemma 3: 33 of a 4,096-token
# context's 256), and a step computing a prompt's chunk one per block of the chunk (a chunk
# takes what parts are free: `KVCacheManager.fit_window`).
WINDOW_SHARE = 0.25
PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class CacheSize:
    num_blocks: int
    window_blocks: int | None  # window parts that fit (None: no windowed layers, or kept)

    @property
    def overcommitted(self) -> bool:
        """Whether the windowed layers' tensors address more blocks than parts fit."""
        return self.window_blocks is not None and self.window_blocks < self.num_blocks


def cache_size(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> CacheSize:
    """Blocks, and window parts, for `cache`: its `num_blocks` (and `num_window_blocks`), or
    what its memory budget buys. Parts are sized apart only where their memory can go back a
    block at a time (a layer's block a whole number of pages); elsewhere every block keeps
    its part's memory, and the pool still frees what is behind the windows for other blocks."""
    windowed = bool(model.local_layers) and cache.window_memory
    least = 0  # window parts one request's window reads: every request can always go on
    if windowed:
        assert model.sliding_window is not None
        least = -(-model.sliding_window // cache.block_size) + 2
    if cache.num_blocks is not None:
        if not windowed:
            return CacheSize(cache.num_blocks, None)
        window = cache.num_window_blocks or cache.num_blocks
        if window < min(least, cache.num_blocks):
            raise KVCacheSizeError(
                f"{window} window parts of blocks: a request's window reads {least}"
            )
        return CacheSize(cache.num_blocks, window)
    layer_bytes = layer_block_bytes(model, cache.block_size, dtype)
    per_block = bytes_per_block(model, cache.block_size, dtype)
    share = 1.0
    if windowed and layer_bytes % PAGE == 0:
        share = WINDOW_SHARE
        local = len(model.local_layers)
        per_block = (model.num_layers - local) * layer_bytes + int(share * local * layer_bytes)
    n = cache.kv_cache_memory // per_block
    if n < 1:
        raise KVCacheSizeError(
            f"--kv-cache-memory {cache.kv_cache_memory} B is below one block ({per_block} B)"
        )
    if not windowed:
        return CacheSize(int(n), None)
    return CacheSize(int(n), max(min(int(n), least), int(n * share)))


def num_blocks_for(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    return cache_size(model, cache, dtype).num_blocks


def allocate_kv_cache(
    model: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    lazy: bool = False,
) -> list[torch.Tensor]:
    """`lazy`: the windowed layers' tensors are not backed until their blocks are written
    (their window parts; the others are pre-faulted)."""
    shape = (num_blocks, 2, model.num_kv_heads, block_size, model.head_dim)
    caches = []
    for i in range(model.num_layers):
        if lazy and i in model.local_layers:
            # 4 KiB pages: a block written backs its own pages, not a 2 MiB huge page.
            tensor = small_page_buffer(_nbytes(shape, dtype)).view(dtype).view(shape)
        else:
            tensor = allocate_kv_layer(shape, dtype)
            # empty + zero_ writes every page now (torch.zeros may map lazily-zeroed pages).
            tensor.zero_()
        caches.append(tensor)
    return caches


def allocate_kv_layer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A full-attention layer's cache, empty: in transparent huge pages where the host has
    them (else 4 KiB pages of a mapping of its own).
    The transfer plane reads and writes a request's blocks wherever the pool put them: on
    4 KiB pages a scattered block costs TLB walks and stops the prefetchers at each page, and
    a plain socket moved scattered 12 KiB blocks ~1.15x slower than one span; on 2 MiB pages
    ~1.08x (benchmarks/transfer.py's `plain_same_blocks` vs `plain_socket`, Zen 4)."""
    nbytes = _nbytes(shape, dtype)
    buffer = huge_page_buffer(nbytes)
    if buffer is None:  # page-aligned all the same (torch's allocator aligns to 64 bytes only)
        buffer = small_page_buffer(nbytes)
    return buffer.view(dtype).view(shape)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


_MADV_DONTNEED = 4  # private memory: the pages go back; touched again, they read as zeros
_MADV_REMOVE = 9  # shared memory (tensor-parallel ranks' caches): the same, for every mapping


class WindowMemory:
    """The windowed layers' cache tensors (every tensor-parallel rank's): `drop(block)` gives
    the memory of that block in each back to the system (its pages wholly inside the block:
    all of them where a layer's block is a whole number of pages)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._madvise = libc.madvise
        self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._madvise.restype = ctypes.c_int
        self.spans = [
            (
                t.data_ptr(),
                t[0].numel() * t.element_size() if t.shape[0] else 0,
                t.shape[0],
                _MADV_REMOVE if t.is_shared() else _MADV_DONTNEED,  # type: ignore[no-untyped-call]
            )
            for t in tensors
        ]
        self.bytes_returned = 0

    def _advise(self, start: int, size: int, advice: int) -> None:
        first = -(-start // PAGE) * PAGE
        end = (start + size) // PAGE * PAGE
        if end <= first:
            return
        if self._madvise(first, end - first, advice) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise of the KV cache's window memory failed: errno {err}")
        self.bytes_returned += end - first

    def drop(self, block: int) -> None:
        for base, size, _, advice in self.spans:
            self._advise(base + block * size, size, advice)


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
    model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, lazy: bool = False
) -> torch.Tensor:
    """A rank's whole cache as one [layers, num_blocks, 2, kv_heads, block_size, head_dim]
    tensor in shared memory, pre-faulted: rank 0 allocates every rank's, so its transport can
    move any rank's heads, and hands each worker its own at spawn. `lazy`: the windowed
    layers' memory is not backed until written (as `allocate_kv_cache`)."""
    shape = (model.num_layers, num_blocks, 2, model.num_kv_heads, block_size, model.head_dim)
    cache = torch.empty(shape, dtype=dtype)
    cache.share_memory_()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    for i in range(model.num_layers):  # fresh shared memory reads as zeros: this backs it
        if not (lazy and i in model.local_layers):
            cache[i].zero_()
    return cache
