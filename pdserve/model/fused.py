"""The compiled CPU kernels (`csrc/`): built once per machine by torch's C++ extension builder
(g++ and ninja) into torch's extension cache (`$TORCH_EXTENSIONS_DIR`, default
~/.cache/torch_extensions), one folder per installed copy of pdserve, torch and Python (rebuilt
when the source changes), and loaded on first use. Where they cannot be built, pdserve says so
once and runs the plain torch path: same results within rounding, slower.

Builders take turns through an flock on the build folder, which the kernel lets go when a
builder dies. torch's own lock file does not go away when its builder is killed, and torch
waits on it without end; whoever holds the flock removes one left behind.

`python -m pdserve.model.fused` builds them ahead of time (`make install` does).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "module.cpp",
        "paged_attention.cpp",
        "bf16_linear.cpp",
        "quant_linear.cpp",
        "decode_layers.cpp",
    )
]
# -fopenmp: at::parallel_for is inlined from ATen's headers and runs serially without it (the
# kernels ran on one thread before it was set; the decode attention then took 2x as long).
FLAGS = ["-O3", "-march=native", "-fopenmp"]

# (q [D, heads, dim], cache [N, 2, kv_heads, block, dim], block tables [D, max_blocks] int32,
#  context lengths [D] int32, scale) -> [D, heads, dim]
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], Any]
# (q [Q, heads, dim], cache, block table [blocks] int32, context length, scale) -> [Q, heads, dim]
PrefillKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], Any]
# (x [M, K] bf16, w [N, K] bf16, bias [N] bf16 or None) -> [M, N] bf16
LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
_module: list[Any] = []  # empty: not tried yet
NAME = "pdserve_cpu_kernels"
BUILD_WAIT_S = 900.0  # another process building (about a minute on 2 cores) is waited for this long


def compiled() -> Any:
    """The compiled module, built if needed; None if it cannot be (logged once)."""
    if not _module:
        _module.append(_build())
    return _module[0]


def paged_decode_kernel() -> DecodeKernel | None:
    """The fused decode attention; None where the kernels cannot be built."""
    module = compiled()
    return None if module is None else module.paged_decode_attention  # type: ignore[no-any-return]


def paged_prefill_kernel() -> PrefillKernel | None:
    """Attention for a run of queries over a cached prefix, straight from the paged cache;
    None where the kernels cannot be built."""
    module = compiled()
    return None if module is None else module.paged_prefill_attention  # type: ignore[no-any-return]


def bf16_linear_kernel() -> LinearKernel | None:
    """x W^T + b for a few rows of bf16, each weight row read once (csrc/bf16_linear.cpp);
    None where the kernels cannot be built."""
    module = compiled()
    return None if module is None else module.bf16_linear  # type: ignore[no-any-return]


def build_directory() -> Path:
    """Where this copy of pdserve builds its kernels: two checkouts sharing the cache would
    otherwise rebuild over each other (their build files name different source paths)."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    copy = f"{CSRC.resolve()}|{torch.__version__}|{sys.version_info[:2]}"
    return Path(root) / f"{NAME}-{hashlib.sha256(copy.encode()).hexdigest()[:12]}"


def take_turn(turn: IO[str], wait_s: float) -> None:
    """Hold the build folder's flock (`turn`: its `pdserve.lock`, open), waiting at most
    `wait_s` for another process to let it go."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(turn, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"another process held {turn.name} for {wait_s:.0f} s") from None
            time.sleep(0.2)


def _build() -> Any:
    from torch.utils import cpp_extension

    try:
        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / "pdserve.lock", "a") as turn:
            take_turn(turn, BUILD_WAIT_S)
            # No one else builds here while the flock is held: torch's lock is a dead builder's.
            (directory / "lock").unlink(missing_ok=True)
            return cpp_extension.load(
                name=NAME,
                sources=[str(s) for s in SOURCES],
                extra_cflags=FLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
            )
    except Exception as e:  # no compiler, no ninja, a broken toolchain: the torch path runs
        logger.warning("compiled CPU kernels unavailable (%s); using the torch paths", e)
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(f"compiled CPU kernels: {'ready' if compiled() is not None else 'unavailable'}")
    sys.exit(0)
