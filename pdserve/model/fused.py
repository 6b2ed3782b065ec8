"""The compiled CPU kernels (`csrc/`): built once per machine by torch's C++ extension builder
(g++ and ninja) into torch's extension cache (`$TORCH_EXTENSIONS_DIR`, default
~/.cache/torch_extensions; rebuilt when the source or torch changes) and loaded on first use.
Where they cannot be built, pdserve says so once and runs the plain torch path: same results
within rounding, slower.

`python -m pdserve.model.fused` builds them ahead of time (`make install` does).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _build() -> Any:
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            name="pdserve_cpu_kernels",
            sources=[str(s) for s in SOURCES],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # no compiler, no ninja, a broken toolchain: the torch path runs
        logger.warning("compiled CPU kernels unavailable (%s); using the torch paths", e)
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(f"compiled CPU kernels: {'ready' if compiled() is not None else 'unavailable'}")
    sys.exit(0)
