"""Decode attention, side by side in one run: pdserve's compiled CPU kernel vs the torch path it
replaces, on SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head dim 64, block
size 16) at several batch sizes and context lengths, blocks scattered over the pool. Both read
the same paged caches, one per layer read in turn as a decode step does (`--layers`, 30: each
cold when its turn comes); times are per layer. Outputs are checked to agree before timing.
Then the whole engine on an offline workload (64 requests, 128-1024-token prompts, 64-128
output tokens, bf16 SmolLM2) with each backend, alternating. Writes
benchmarks/results/decode_attention.json.

    .venv/bin/python benchmarks/decode_attention.py [--no-engine] [--baseline-rev REV]

--baseline-rev also builds the kernel as it was at git revision REV and times it beside today's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.config import CacheConfig, EngineConfig, default_cache_dir
from pdserve.engine.kv_cache import allocate_kv_layer
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import _decode_batch
from pdserve.engine.sequence import SamplingParams
from pdserve.model.attention import _decode_attention
from pdserve.model.fetch import resolve_model
from pdserve.model.fused import paged_decode_kernel

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
LOADS = [(1, 512), (4, 560), (16, 600), (64, 600), (64, 1200), (1, 2048), (1, 8192), (4, 4096)]
# (sequences, context): the last three long enough to be decoded in parts (DecodePart)


def timed(fn: Any, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


BASELINE_MODULE = """#include <torch/extension.h>
#include "kernels.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
}
"""


def baseline_kernel(rev: str) -> Any:
    """paged_decode_attention as built from git revision `rev`'s sources."""
    from torch.utils import cpp_extension

    from pdserve.model.fused import FLAGS, LEVEL_FLAGS
    from pdserve.model.isa import chosen_isa

    src = Path(tempfile.mkdtemp(prefix="decode-baseline-"))
    for name in ("paged_attention.cpp", "simd.h", "kernels.h"):
        text = subprocess.run(["git", "show", f"{rev}:pdserve/model/csrc/{name}"], check=True,
                              capture_output=True, text=True).stdout  # fmt: skip
        (src / name).write_text(text)
    (src / "module.cpp").write_text(BASELINE_MODULE)
    rev_id = subprocess.run(["git", "rev-parse", "--short", rev], check=True, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    level = chosen_isa().kernel_level
    return cpp_extension.load(
        name=f"pdserve_decode_{rev_id}_{level.name.lower()}",
        sources=[str(src / "paged_attention.cpp"), str(src / "module.cpp")],
        extra_cflags=FLAGS + LEVEL_FLAGS[level],  # built for this host's level, as today's
        extra_ldflags=["-fopenmp"],
    )


def old_kernel(baseline: Any, *args: Any) -> Any:
    """The baseline's decode attention, which may predate the window argument (0 here)."""
    try:
        return baseline.paged_decode_attention(*args)
    except TypeError:
        return baseline.paged_decode_attention(*args[:5])


def measure(
    seqs: int, context: int, dtype: torch.dtype, repeats: int, layers: int, baseline: Any = None
) -> dict[str, Any]:
    """Per-layer times of each path over `layers` layers' caches in turn (as a decode step)."""
    kernel = paged_decode_kernel()
    if kernel is None:
        raise SystemExit("the CPU kernel did not build (g++ and ninja are needed)")
    rng = random.Random(seqs * context)
    num_blocks = seqs * (-(-context // BLOCK)) + 8
    # a decode step reads each layer's own cache: `layers` of them, each cold when its turn comes
    # (one cache timed over and over would sit in the L2 and show none of the reading)
    caches = [
        allocate_kv_layer((num_blocks, 2, KV_HEADS, BLOCK, DIM), dtype).normal_()
        for _ in range(layers)
    ]
    cache = caches[0]
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-context // BLOCK))] for _ in range(seqs)]
    lengths = [context] * seqs
    q = torch.randn(seqs, HEADS, DIM).to(dtype)
    rows = list(range(seqs))
    fused = _decode_batch(rows, tables, lengths, BLOCK, kernel)
    plain = _decode_batch(rows, tables, lengths, BLOCK, None)
    assert fused is not None and plain is not None
    a, b = _decode_attention(q, cache, fused), _decode_attention(q, cache, plain)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol), "outputs disagree"
    paths = {"fused": fused, "torch": plain}
    if baseline is not None:
        old = _decode_batch(rows, tables, lengths, BLOCK, lambda *a: old_kernel(baseline, *a))
        assert old is not None
        assert torch.allclose(_decode_attention(q, cache, old).float(), a.float(), atol=tol,
                              rtol=tol), "the baseline kernel disagrees"  # fmt: skip
        paths["baseline"] = old
    times: dict[str, list[float]] = {name: [] for name in paths}
    with torch.inference_mode():
        for _ in range(3):  # the paths alternate; each keeps its median
            for name, batch in paths.items():
                step = lambda b=batch: [_decode_attention(q, c, b) for c in caches]  # noqa: E731
                times[name].append(timed(step, repeats) / layers)
    t_fused, t_torch = (sorted(times[name])[1] for name in ("fused", "torch"))
    row = {
        "sequences": seqs,
        "context": context,
        "dtype": str(dtype).removeprefix("torch."),
        "fused_ms": 1e3 * t_fused,
        "torch_ms": 1e3 * t_torch,
        "speedup": t_torch / t_fused,
    }
    if baseline is not None:
        t_old = sorted(times["baseline"])[1]
        row.update(baseline_ms=1e3 * t_old, speedup_vs_baseline=t_old / t_fused)
    return row


def engine_run(backend: str, threads: int, requests: int) -> dict[str, Any]:
    """Output tokens/s of LLMEngine.generate on the fixed workload with one backend."""
    model_dir = resolve_model("default", default_cache_dir(), "bfloat16")
    config = EngineConfig(
        dtype="bfloat16",
        num_threads=threads,
        cache=CacheConfig(num_blocks=8192),
        attention_backend=backend,
    )
    engine = LLMEngine(config, model_dir)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(128, 1024))]
               for _ in range(requests)]  # fmt: skip
    params = [
        SamplingParams(max_tokens=rng.randint(64, 128), temperature=0.0, ignore_eos=True)
        for _ in prompts
    ]
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"backend": backend, "output_tokens": tokens, "seconds": elapsed,
            "output_tokens_per_s": tokens / elapsed}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default="benchmarks/results/decode_attention.json")
    ap.add_argument("--no-engine", action="store_true", help="kernels only")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--baseline-rev", help="also time the kernel as built at this git revision")
    ap.add_argument("--layers", type=int, default=30, help="caches read in turn (SmolLM2: 30)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    baseline = baseline_kernel(args.baseline_rev) if args.baseline_rev else None
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for seqs, context in LOADS:
            row = measure(seqs, context, dtype, args.repeats, args.layers, baseline)
            rows.append(row)
            versus = (f", {args.baseline_rev}'s kernel {row['baseline_ms']:7.2f} ms "
                      f"({row['speedup_vs_baseline']:.2f}x)" if baseline else "")  # fmt: skip
            print(
                f"{row['dtype']:>8} {seqs:3d} x {context:5d}: fused {row['fused_ms']:7.2f} ms, "
                f"torch {row['torch_ms']:7.2f} ms per layer ({row['speedup']:.1f}x){versus}",
                flush=True,
            )
    result: dict[str, Any] = {
        "threads": args.threads,
        "layers": args.layers,
        "baseline_rev": args.baseline_rev,
        "shape": [HEADS, KV_HEADS, DIM, BLOCK],
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if not args.no_engine:
        runs = [
            engine_run(b, args.threads, args.requests) for b in ("torch", "auto", "torch", "auto")
        ]
        for r in runs:
            print(
                f"engine, {r['backend']}: {r['output_tokens_per_s']:.1f} output tok/s", flush=True
            )
        mean = {
            b: sum(r["output_tokens_per_s"] for r in runs if r["backend"] == b) / 2
            for b in ("torch", "auto")
        }
        result["engine"] = {"runs": runs, "speedup": mean["auto"] / mean["torch"]}
        out.write_text(json.dumps(result, indent=2))
        print(f"engine speedup (fused vs torch): {result['engine']['speedup']:.2f}x")


if __name__ == "__main__":
    main()
