"""The model's weights in transparent huge pages (2 MiB), in the order a decode step reads them.

A batch-1 decode step reads every weight once (SmolLM2 in bf16: 270 MB) and is bound by how
fast memory streams. On 4 KiB pages the CPU's hardware prefetchers stop at every page boundary
and every page costs a TLB walk: on a 2-core AVX512-BF16 EPYC the layers' panel kernels read
the weights at ~25 GB/s from 4 KiB pages and ~34 GB/s from 2 MiB pages, the output projection's
row kernel ~24 vs ~37 GB/s (alternating in one process, /proc/self/smaps confirming the huge
pages). torch's allocator asks for huge pages only when C10_THP_MEM_ALLOC_ENABLE is set before
torch loads, and hosts mostly run THP in `madvise` mode, so `move_to_huge_pages` copies the
weights into one private anonymous mapping advised MADV_HUGEPAGE, back to back in the order
given. Each tensor keeps its identity (`Tensor.set_`): every module, list and tied parameter
that holds it reads the new memory, and the old memory goes back to the system. Where THP is
off (`never`, not Linux) nothing moves.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), "" where there is
    none (not Linux, or no THP)."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """A uint8 tensor of `nbytes` on 2 MiB-aligned memory advised MADV_HUGEPAGE (the mapping
    lives as long as any view of it), or None where this host cannot have one."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or thp_mode() not in ("always", "madvise"):
        return None
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    start = -whole.data_ptr() % HUGE_PAGE  # a multiple of the 4 KiB page madvise wants
    mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return whole[start : start + nbytes]


def small_page_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` in a private anonymous mapping of its own (page-aligned,
    untouched: its pages are backed as they are written), advised MADV_NOHUGEPAGE where the
    host has THP, so that it is backed by 4 KiB pages in every THP mode. Memory from torch's
    allocator may lie in glibc's heap, whose pages THP may back as it chose for the heap
    (a suite's process once had a windowed KV layer there in a 2 MiB page in `madvise` mode)."""
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE") and thp_mode():
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]  # keeps the mapping alive


def _return_freed_memory() -> None:
    """Give the old copies' pages back to the system. Most weights came from glibc's heap (its
    mmap threshold rises as loading frees large temporaries), which keeps freed pages: without
    this a SmolLM2 bf16 engine held ~110 MB more than one whose weights stay put, with it ~10 MB
    more (malloc_trim(0) returns every whole free page of every arena). Not glibc: nothing to do."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _movable(t: torch.Tensor) -> bool:
    """A dense CPU tensor that is all of its storage (moving a view would leave its base's
    memory held, and the two copies apart)."""
    return (
        t.device.type == "cpu"
        and t.numel() > 0
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Copy each movable tensor into one huge-page buffer, in order (a tensor given twice, as a
    tied weight, once), and point the tensor at its copy. A storage that two tensors share (a
    view and its base) stays where it is. Returns the bytes moved (0: nothing, THP off)."""
    holders: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        if t.layout != torch.strided or t.is_mkldnn:  # oneDNN's packed weights: opaque
            continue
        same = holders.setdefault(t.untyped_storage().data_ptr(), [])
        if all(other is not t for other in same):
            same.append(t)
    chosen = [same[0] for same in holders.values() if len(same) == 1 and _movable(same[0])]
    offsets, total = [], 0
    for t in chosen:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    if total < HUGE_PAGE:
        return 0
    buffer = huge_page_buffer(total)
    if buffer is None:
        logger.info("weights stay in 4 KiB pages: transparent huge pages are %r here",
                    thp_mode() or "absent")  # fmt: skip
        return 0
    with torch.no_grad():
        for t, offset in zip(chosen, offsets, strict=True):
            nbytes = t.numel() * t.element_size()
            copy = buffer[offset : offset + nbytes].view(t.dtype).view(t.shape)
            copy.copy_(t)
            t.set_(copy)  # type: ignore[call-overload]  # same tensor, new memory
    _return_freed_memory()
    logger.info("weights in huge pages: %d MiB in %d tensors", total >> 20, len(chosen))
    return total
