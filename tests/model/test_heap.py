"""The memory a step frees is reused by the next (model/heap.py, which every pdserve process
applies at its start): counted by the kernel's minor page faults (getrusage), in a process of
its own so that no other test's allocations shape glibc's state."""

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
# that glibc lets come from the heap (the gate/up output: 24.6 MB); larger ones get mappings of
# their own and are faulted in every step still (see model/heap.py).
ROWS, INTER = 3 * 1000, 1024

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
for step in range(8):  # new prompts each step, all of one length
    prompts = [[3 + (step * 7 + i * 13 + j) % (TINY_VOCAB - 3) for i in range(1000)]
               for j in range(3)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


@pytest.mark.skipif(libc_mallopt() is None, reason="this C library has no mallopt (not glibc)")
def test_a_repeated_prompt_step_faults_in_less_than_its_largest_temporary(
    tmp_path: Path,
) -> None:
    model = make_tiny_model(
        tmp_path / "m", hidden_size=256, intermediate_size=INTER, max_position_embeddings=2048
    )
    done = subprocess.run(
        [sys.executable, "-c", STEPS, str(model), "keep"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    faults = json.loads(done.stdout.splitlines()[-1])
    # The gate/up projection's output alone (fp32) is this many pages; memory handed back to
    # the system after a step is faulted in (and zeroed by the kernel) at least once per layer.
    gate_up_pages = ROWS * 2 * INTER * 4 // PAGE
    later = sorted(faults[1:])
    assert later[len(later) // 2] < gate_up_pages, faults
