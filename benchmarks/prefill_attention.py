"""Attention for a run of queries over a cached prefix (chunked prefill, prefix-cache hits), side
by side in one run: pdserve's compiled kernel that reads the paged cache in place ("kernel"), its
fresh-prompt kernel over the context's keys and values gathered as rows ("gather + rows"), and
the torch path (gather the context's blocks, expand the KV heads, SDPA with a causal mask), on
SmolLM2's attention shapes (9 query heads, 3 KV heads, head dim 64, block size 16), blocks
scattered over the pool. Outputs are checked to agree before timing; the paths alternate for
`--rounds` rounds, best of each. Writes benchmarks/results/prefill_attention.json.

    .venv/bin/python benchmarks/prefill_attention.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.model.attention import PrefillSegment, _prefill_attention
from pdserve.model.fused import fresh_prefill_kernel, paged_prefill_kernel

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
# (cached prefix + run, run): a few queries over a long prefix up to a long run over a short one
LOADS = [
    (256, 16),
    (256, 32),
    (1024, 16),
    (1024, 32),
    (1024, 64),
    (1024, 128),
    (1024, 256),
    (2048, 128),
    (2048, 512),
    (600, 584),
]


def timed(fn: Any, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def measure(context: int, queries: int, dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    kernel, rows = paged_prefill_kernel(), fresh_prefill_kernel()
    if kernel is None or rows is None:
        raise SystemExit("the CPU kernel did not build (g++ and ninja are needed)")
    blocks = -(-context // BLOCK)
    cache = torch.randn(blocks + 8, 2, KV_HEADS, BLOCK, DIM).to(dtype)
    table = torch.tensor(random.Random(context).sample(range(blocks + 8), blocks))
    q = torch.randn(queries, HEADS, DIM).to(dtype)
    fresh = torch.empty(queries, KV_HEADS, DIM, dtype=dtype)  # already in the cache
    paths = {
        "kernel": PrefillSegment(0, queries, context, table, kernel, exact=True),
        "gather + rows": PrefillSegment(0, queries, context, table, None, rows),
        "gather + sdpa": PrefillSegment(0, queries, context, table, None),
    }
    outs = [_prefill_attention(q, fresh, fresh, cache, seg).float() for seg in paths.values()]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for out in outs[1:]:
        assert torch.allclose(outs[0], out, atol=tol, rtol=tol), "the paths disagree"
    repeats = max(1, 2_000_000 // (queries * context))
    best = {name: float("inf") for name in paths}
    for _ in range(rounds):
        for name, seg in paths.items():
            t = timed(lambda seg=seg: _prefill_attention(q, fresh, fresh, cache, seg), repeats)
            best[name] = min(best[name], t)
    return {
        "context": context,
        "queries": queries,
        "dtype": str(dtype).removeprefix("torch."),
        "ms": {name: t * 1e3 for name, t in best.items()},
        "speedup": best["gather + sdpa"] / best["kernel"],
        "rows_speedup": best["gather + sdpa"] / best["gather + rows"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "prefill_attention.json"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        for context, queries in LOADS:
            r = measure(context, queries, dtype, args.rounds)
            results.append(r)
            print(
                f"{r['dtype']} context {context} run {queries}: kernel {r['ms']['kernel']:.2f} ms, "
                f"gather + rows {r['ms']['gather + rows']:.2f} ms, "
                f"gather + sdpa {r['ms']['gather + sdpa']:.2f} ms",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"threads": args.threads, "block": BLOCK, "results": results}, indent=2)
    )


if __name__ == "__main__":
    main()
