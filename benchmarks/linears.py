"""The ways a bf16 linear can multiply on this host, side by side in one run, by row count: every
SmolLM2 layer's linears (30 x qkv, o, gate/up, down; each weight its own memory, so read from
RAM as a decode step reads it) through the panel kernel (csrc/bf16_linear.cpp's
bf16_blocked_linear), the row kernel (bf16_linear) and oneDNN's packed weights (torch's
mkldnn linear: AMX tiles where the CPU has them). What `linear_plan` (model/linear.py) chooses
per instruction set is measured with this. Medians of `--rounds`, the three alternating.

    .venv/bin/python benchmarks/linears.py [--threads 2] [--rows 1 2 4 8 16 32 64 128 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdserve.model.fused import bf16_blocked_kernel, bf16_linear_kernel
from pdserve.model.isa import host_description
from pdserve.model.linear import block_weight

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2: out x in features
ROW_KERNEL_ROWS = 64  # beyond, the row kernel is far behind on every host measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    ap.add_argument("--out", default="benchmarks/results/linears.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    panels_kernel, row_kernel = bf16_blocked_kernel(), bf16_linear_kernel()
    if panels_kernel is None or row_kernel is None:
        raise SystemExit("the compiled CPU kernels are not built here (make install builds them)")
    gen = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
        for _ in range(LAYERS)
        for n, k in SHAPES
    ]
    panels = [block_weight(w) for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    ways: dict[str, Callable[[torch.Tensor, int], Any]] = {
        "panels": lambda x, i: panels_kernel(x, panels[i], None),
        "row_kernel": lambda x, i: row_kernel(x, weights[i], None),
        "onednn": lambda x, i: torch.ops.mkldnn._linear_pointwise(
            x, packed[i], None, "none", [], ""
        ),
    }

    def ms(way: str, rows: int) -> float:
        xs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
        start = time.perf_counter()
        for i, w in enumerate(weights):
            ways[way](xs[w.shape[1]], i)
        return (time.perf_counter() - start) * 1e3

    result: dict[str, Any] = {"host": host_description(), "threads": args.threads, "rows": {}}
    for rows in args.rows:
        tried = [w for w in ways if w != "row_kernel" or rows <= ROW_KERNEL_ROWS]
        for way in tried:
            ms(way, rows)  # warm up
        samples: dict[str, list[float]] = {way: [] for way in tried}
        for _ in range(args.rounds):
            for way in tried:
                samples[way].append(ms(way, rows))
        flops = 2 * rows * LAYERS * sum(n * k for n, k in SHAPES)
        cell = {f"{way}_ms": statistics.median(v) for way, v in samples.items()}
        cell.update({f"{way}_gflops": flops / cell[f"{way}_ms"] / 1e6 for way in tried})
        result["rows"][rows] = cell
        print(rows, {k: round(v, 2) for k, v in cell.items()}, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
