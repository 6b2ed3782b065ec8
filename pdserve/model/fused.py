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

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp-simd"]

# (q [D, heads, dim], cache [N, 2, kv_heads, block, dim], block tables [D, max_blocks] int32,
#  context lengths [D] int32, scale) -> [D, heads, dim]
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], Any]
_kernel: list[DecodeKernel | None] = []  # empty: not tried yet


def paged_decode_kernel() -> DecodeKernel | None:
    """The fused decode attention, built if needed; None if it cannot be (logged once)."""
    if not _kernel:
        _kernel.append(_build())
    return _kernel[0]


def _build() -> DecodeKernel | None:
    from torch.utils import cpp_extension

    try:
        module = cpp_extension.load(
            name="pdserve_paged_attention", sources=[str(SOURCE)], extra_cflags=FLAGS
        )
    except Exception as e:  # no compiler, no ninja, a broken toolchain: the torch path runs
        logger.warning("fused CPU attention unavailable (%s); using the torch path", e)
        return None
    kernel: DecodeKernel = module.paged_decode_attention
    return kernel


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(f"fused CPU attention: {'ready' if paged_decode_kernel() else 'unavailable'}")
    sys.exit(0)
