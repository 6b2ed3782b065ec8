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
Larger chunks glibc will not take from the heap by a threshold; only `M_MMAP_MAX` 0 keeps them
there (as the tcmalloc vLLM's CPU backend preloads keeps everything). `keep_step_memory` sets it
once the model is in place, in a process that keeps freed memory: a larger model's or step's
temporaries (a 1B Llama's gate/up output of a 2,040-token prompt is 64 MiB) are then reused too.
Not from the start: what loading allocates and frees (weights before they move to huge pages)
would stay in the heap; loading's free memory goes back first (`malloc_trim`). And one arena
(`M_ARENA_MAX` 1, from the start, before any thread has one of its own): a node's engine runs on
a thread of its own, and a thread's own arena grows in heaps of 64 MiB at most; a chunk that
fits none gets a mapping of its own whatever M_MMAP_MAX says, and was faulted in again at every
step where that happened (with M_MMAP_MAX 0 alone, 8,000-94,000 faults in 2 steps of 3 on the
Llama below; ~0 with one arena). Threads then share one lock for the chunks their own cache
(tcache) does not hold: measured no slower on SmolLM2's waves, where the interpreter's lock
serializes most allocation anyway. `benchmarks/step_memory.py` (an 8-layer Llama of that shape,
bf16, 2 threads, the engine on a thread; `benchmarks/results/step_memory-zen5.json`): 114,000
faults and 0.21 s of system time a step before, ~0 after, 0.93x the step time. Weights and KV
caches lie in mappings of their own (model/hugepages.py) and are not affected; a step's
temporaries stay resident once touched, as the smaller ones already did. Where the C library
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
M_MMAP_MAX = -4
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: a larger value is refused
TRIM_THRESHOLD = 1 << 30
_kept = False  # keep_freed_memory took effect in this process


def _libc_function(name: str) -> Any | None:
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None


def libc_mallopt() -> Any | None:
    """The C library's mallopt, None where it has none."""
    mallopt = _libc_function("mallopt")
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def keep_freed_memory() -> bool:
    """Fixes glibc's mmap and trim thresholds and its arenas to one (see the module's
    docstring) for this process, before it starts threads; False where the C library has no
    mallopt (nothing changes) or refuses a value."""
    mallopt = libc_mallopt()
    if mallopt is None:
        return False
    global _kept
    kept = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    kept = kept and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    kept = kept and mallopt(M_ARENA_MAX, 1) == 1
    if not kept:
        logger.info("malloc keeps its own thresholds: freed step memory may be faulted in again")
    _kept = kept
    return kept


def keep_step_memory() -> bool:
    """Once the model is loaded: the free memory loading left in the heap goes back to the
    system, and every later chunk comes from the heap, however large (see the module's
    docstring). Only in a process where `keep_freed_memory` took effect (a pdserve process,
    not a library user's or a test runner's); False, changing nothing, elsewhere."""
    mallopt, trim = libc_mallopt(), _libc_function("malloc_trim")
    if not _kept or mallopt is None or trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    if mallopt(M_MMAP_MAX, 0) != 1:
        logger.info("malloc keeps its mmap limit: a step's largest temporaries are faulted in")
        return False
    return True
