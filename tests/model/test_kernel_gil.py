"""The compiled kernels let go of the GIL while they compute: the event loop's thread streams the
tokens of the step before while a step's kernels run (a decode step's layers are one call), so a
kernel must never keep every other Python thread waiting for its end."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pdserve.model.fused import fresh_prefill_kernel


def test_another_thread_runs_python_while_a_kernel_computes() -> None:
    kernel = fresh_prefill_kernel()
    if kernel is None:
        pytest.skip("this host's kernel build is generic: it has no fresh-prompt attention")
    n, dim = 32768, 64  # causal attention over 32,768 positions: ~34 GFLOP, 8 MiB a tensor
    q, k, v = (torch.randn(n, 1, dim) for _ in range(3))
    entering = threading.Event()
    ran: dict[str, float] = {}

    def compute() -> None:
        entering.set()
        ran["start"] = time.monotonic()
        kernel(q, k, v, dim**-0.5)
        ran["end"] = time.monotonic()

    worker = threading.Thread(target=compute)
    worker.start()
    entering.wait(30)
    # Holding the GIL, the kernel would keep this thread from running any Python (its wake from
    # the sleep included) until it returned.
    time.sleep(0.02)
    woke = time.monotonic()
    worker.join(120)
    assert not worker.is_alive()
    took = ran["end"] - ran["start"]
    assert woke < ran["end"], (
        f"this thread ran again only {woke - ran['end']:.3f} s after the kernel's end "
        f"(the kernel took {took:.3f} s): the kernel held the GIL"
    )
