"""A prompt whose first blocks are in the prefix cache (a chat template's system prompt, a shared
instruction) against a prompt of the same length with nothing cached, side by side in one run:
pdserve's offline engine, SmolLM2, one output token (the prompt's own prefill time, no queue).
The hit computes fewer positions, so it should take no longer than the miss; before the rows
kernel took runs over a cached prefix, the hit went through torch's SDPA and took ~1.4x the miss.
Alternates hit and miss for `--rounds` rounds (fresh prompts each round); writes medians.

    .venv/bin/python benchmarks/prefix_hit.py [--threads 1] [--prefix 32] [--length 542]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import warnings
from pathlib import Path

import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, default_cache_dir
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from pdserve.model.fetch import resolve_model
from pdserve.model.isa import host_description


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="1: a prefill node's; 2: colocated")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prefix", type=int, default=32, help="shared tokens (whole blocks are hit)")
    ap.add_argument("--length", type=int, default=542, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "prefix_hit.json"
    )
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    cfg = EngineConfig(
        dtype=args.dtype,
        num_threads=args.threads,
        cache=CacheConfig(kv_cache_memory=512 * 1024**2, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=4096),
    )
    engine = LLMEngine(cfg, resolve_model("default", default_cache_dir(), args.dtype))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:  # ordinary vocabulary ids
        return [rng.randrange(100, 49000) for _ in range(n)]

    shared = tokens(args.prefix)
    engine.generate([shared + tokens(40)], params)  # caches the shared blocks; warms up
    times: dict[str, list[float]] = {"hit": [], "miss": []}
    cached: list[int] = []
    for _ in range(args.rounds):
        for case in ("hit", "miss"):
            prompt = (shared if case == "hit" else tokens(args.prefix)) + tokens(
                args.length - args.prefix
            )
            start = time.perf_counter()
            out = engine.generate([prompt], params)[0]
            times[case].append(time.perf_counter() - start)
            if case == "hit":
                cached.append(out.num_cached_tokens)
    ms = {case: statistics.median(t) * 1e3 for case, t in times.items()}
    result = {
        "host": host_description(),
        "threads": args.threads,
        "dtype": args.dtype,
        "prompt_tokens": args.length,
        "shared_tokens": args.prefix,
        "cached_tokens": sorted(set(cached)),
        "rounds": args.rounds,
        "ms_median": ms,
        "ms_all": {case: [t * 1e3 for t in ts] for case, ts in times.items()},
        "hit_over_miss": ms["hit"] / ms["miss"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"hit {ms['hit']:.0f} ms, miss {ms['miss']:.0f} ms: {result['hit_over_miss']:.2f}x")


if __name__ == "__main__":
    main()
