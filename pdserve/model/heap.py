"""glibc's malloc told to keep the memory a step frees, so that the next step reuses it rather
than faulting fresh pages in.

A prompt step allocates and frees its temporaries layer by layer (a wave of four 542-token
SmolLM2 prompts: ~900 MB over the step, 13 MB the largest). By default glibc adapts its
thresholds as it goes: chunks above the mmap threshold get mappings of their own, handed back
when freed, and a heap top grown past the trim threshold is handed back too, so each step
faults its pages in again and the kernel zeroes every one. On a 2-core Xeon with AMX that was
20,000-120,000 minor faults and up to 0.2 s of system time a wave of four prompts, and the
wave took a median of 364-506 ms against 341-380 ms with the thresholds fixed (3 alternating
processes, 8 waves each; the faults went to ~0). `keep_freed_memory`, called by every pdserve
process at its start (`cli.main`, tensor-parallel workers), not by a library user's, fixes them:
chunks up to 32 MiB (the most glibc allows) come from the heap, and up to 1 GiB of free heap top
is kept. Not in a process that runs many different workloads, as a test runner does: set in
`load_model`, so in pytest's workers too, two fresh-clone CI runs took 30 and 43 minutes, with
timeouts, against 25 before (suspected: what they freed kept fragmented; not measured).
Larger tensors still get mappings of their own (weights, KV caches, and a larger model's or
step's temporaries, which are then faulted in every step still: only `M_MMAP_MAX` 0 or another
allocator, as the tcmalloc vLLM's CPU backend preloads, would keep those). Where the C library
has no mallopt (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: a larger value is refused
TRIM_THRESHOLD = 1 << 30


def libc_mallopt() -> Any | None:
    """The C library's mallopt, None where it has none."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def keep_freed_memory() -> bool:
    """Fixes glibc's mmap and trim thresholds (see the module's docstring) for this process;
    False, changing nothing, where the C library has no mallopt or refuses the values."""
    mallopt = libc_mallopt()
    if mallopt is None:
        return False
    kept = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    kept = kept and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not kept:
        logger.info("malloc keeps its own thresholds: freed step memory may be faulted in again")
    return kept
