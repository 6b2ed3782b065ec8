"""What --deterministic costs: the engine's throughput with and without it on the same load,
side by side in one run, bf16 and float32, rounds alternating.

Load (fixed seed): SmolLM2-135M, N requests at once with prompts of 256-768 tokens and 32 output
tokens each (ignore_eos, so both modes produce the same number of tokens), continuous batching;
throughput is (prompt + output tokens) / seconds, and output tokens / seconds, per mode; the
ratio is deterministic / default (aim >= 0.70). Each round builds both engines afresh and runs
the load once to warm up, then timed; the modes alternate which goes first.

    .venv/bin/python benchmarks/deterministic.py [--requests 16] [--rounds 3] [--dtypes ...]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, default_cache_dir
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from pdserve.model.fetch import resolve_model
from pdserve.model.isa import host_description

OUTPUT_TOKENS = 32


def workload(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(256, 768))] for _ in range(n)]


def run(dtype: str, deterministic: bool, prompts: list[list[int]], threads: int) -> float:
    """Seconds for the load on a fresh engine (after one untimed run of it)."""
    config = EngineConfig(
        dtype=dtype,
        num_threads=threads,
        cache=CacheConfig(num_blocks=4096, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=2048),
        deterministic=deterministic,
    )
    engine = LLMEngine(config, resolve_model("default", default_cache_dir(), dtype))
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params)
    start = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--out", default="benchmarks/results/deterministic.json")
    args = ap.parse_args()
    prompts = workload(args.requests, seed=0)
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = OUTPUT_TOKENS * len(prompts)
    results: dict[str, Any] = {}
    for dtype in args.dtypes:
        seconds: dict[str, list[float]] = {"default": [], "deterministic": []}
        for r in range(args.rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            for det in order:
                s = run(dtype, det, prompts, args.threads)
                seconds["deterministic" if det else "default"].append(s)
                print(f"{dtype} round {r} {'deterministic' if det else 'default'}: {s:.2f} s")
        med = {mode: statistics.median(s) for mode, s in seconds.items()}
        results[dtype] = {
            "seconds": seconds,
            "tokens_per_s": {m: (prompt_tokens + output_tokens) / s for m, s in med.items()},
            "output_tokens_per_s": {m: output_tokens / s for m, s in med.items()},
            "ratio": med["default"] / med["deterministic"],
        }
    out = {
        "host": host_description(),
        "model": "SmolLM2-135M-Instruct",
        "requests": args.requests,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "threads": args.threads,
        "rounds": args.rounds,
        "torch": torch.__version__,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v["ratio"] for k, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
