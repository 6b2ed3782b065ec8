"""The memory a step frees is reused by the next (model/heap.py, which every pdserve process
applies at its start and once its model is loaded): counted by the kernel's minor page faults
(getrusage), in a process of its own so that no other test's allocations shape glibc's
state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.model.heap import libc_mallopt
from tests.helpers import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
PAGE = 4096
# A step of three 1,000-token prompts; the MLP's width. Its temporaries stay under the 32 MiB
# that glibc's mmap threshold lets come from the heap (the gate/up output: 24.6 MB); with the
# wider MLP the gate/up output (74 MB) is above it, and above the 64 MiB of a thread's own
# arena's heaps: it comes from the heap only once the model is loaded (keep_step_memory) and
# with one arena (keep_freed_memory).
ROWS, INTER, WIDE = 3 * 1000, 1024, 3072

STEPS = """
import json, resource, sys
from pathlib import Path
from pdserve.engine.sequence import SamplingParams
from pdserve.model.heap import keep_freed_memory
from tests.helpers import TINY_VOCAB, make_engine
if sys.argv[2] == "keep":  # as every pdserve process does at its start (cli.main)
    assert keep_freed_memory()
# blocks for one step's prompts and little more: the first step touches every one
engine = make_engine(Path(sys.argv[1]), num_blocks=192, prefix_caching=False,
                     max_batched_tokens=4096)
faults = []
def steps():  # on a thread of its own, as a node's engine runs
    for step in range(8):  # new prompts each step, all of one length
        prompts = [[3 + (step * 7 + i * 13 + j) % (TINY_VOCAB - 3) for i in range(1000)]
                   for j in range(3)]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
import threading
thread = threading.Thread(target=steps)
thread.start()
thread.join()
# Where a chunk larger than anything free in the heap comes from now: glibc's heap, or a
# mapping of its own (a THP-always host backs such a mapping with few huge-page faults: the
# count alone would not tell).
import torch
big = torch.empty(64 << 20, dtype=torch.float32)  # 256 MiB
heap = [line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
start, end = (int(x, 16) for x in heap[0].split("-")) if heap else (0, 0)
print(json.dumps({"faults": faults, "in_heap": start <= big.data_ptr() < end}))
"""


@pytest.mark.skipif(libc_mallopt() is None, reason="this C library has no mallopt (not glibc)")
def test_a_repeated_prompt_step_faults_in_less_than_its_largest_temporary(
    tmp_path: Path,
) -> None:
    faults = _steps(tmp_path, INTER)["faults"]
    # The gate/up projection's output alone (fp32) is this many pages; memory handed back to
    # the system after a step is faulted in (and zeroed by the kernel) at least once per layer.
    gate_up_pages = ROWS * 2 * INTER * 4 // PAGE
    later = sorted(faults[1:])
    assert later[len(later) // 2] < gate_up_pages, faults


@pytest.mark.skipif(libc_mallopt() is None, reason="this C library has no mallopt (not glibc)")
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="no /proc/self/maps here")
def test_temporaries_above_the_mmap_threshold_are_reused_once_the_model_is_loaded(
    tmp_path: Path,
) -> None:
    run = _steps(tmp_path, WIDE)
    gate_up_pages = ROWS * 2 * WIDE * 4 // PAGE
    assert gate_up_pages * PAGE > 64 << 20  # above a thread arena's heap, and the threshold
    later = sorted(run["faults"][1:])
    assert later[len(later) // 2] < gate_up_pages, run
    assert run["in_heap"], "a large chunk got a mapping of its own after loading"


def _steps(tmp_path: Path, inter: int) -> dict:
    model = make_tiny_model(
        tmp_path / "m", hidden_size=256, intermediate_size=inter, max_position_embeddings=2048
    )
    done = subprocess.run(
        [sys.executable, "-c", STEPS, str(model), "keep"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])
