"""What sliding-window layers hold of the KV cache: Gemma 3 270M (the bundled `gemma3-270m`,
bf16; 18 layers, 15 of them windowed at 512 positions) with a 4,096-token prompt decoding,
the window parts of blocks sized apart and given back (the default) vs every block keeping
every layer (`window_memory=False`, as a NIXL node keeps it), each in a process of its own.

Reported for each, while the request decodes: the bytes the block pool says the context
holds (every layer's used blocks, or the full layers' used blocks plus the windowed layers'
held parts), as a share of every layer's every block (full-attention paging); the process's
resident memory before the engine, once built and at its peak while the request runs (the
weights are the same in both; a kept cache is backed whole when built, a cache with parts
apart backs its windowed layers' blocks as they are written); the blocks and parts a 1 GiB
budget buys; the decode step time (noisy here). Not a timing claim: the memory is the point.

    .venv/bin/python benchmarks/window_memory.py [--tokens 4096] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, default_cache_dir
from pdserve.engine.kv_cache import PAGE
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from pdserve.model.fetch import resolve_model
from pdserve.model.isa import host_description

BUDGET = 1 << 30
OUTPUT_TOKENS = 32


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def measure(window_memory: bool, tokens: int, out: Any) -> None:
    torch.set_num_threads(2)
    config = EngineConfig(
        dtype="bfloat16",
        cache=CacheConfig(kv_cache_memory=BUDGET, window_memory=window_memory),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=tokens),
    )
    model_dir = resolve_model("gemma3-270m", default_cache_dir(), "bfloat16")
    before = _resident()
    engine = LLMEngine(config, model_dir)
    model, pool = engine.model_config, engine.pool
    local, layers = len(model.local_layers), model.num_layers
    built = _resident()
    prompt = [100 + (7919 * i) % 200000 for i in range(tokens)]
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request("long", prompt, params)
    ratios, steps = [], []
    peak = 0
    while engine.requests:
        started = time.perf_counter()
        engine.step()
        seq = engine.requests.get("long")
        if seq is None or not seq.output_token_ids:
            continue
        steps.append(time.perf_counter() - started)
        windows = pool.num_windows_held if pool.windowed else pool.num_used
        held = (layers - local) * pool.num_used + local * windows
        ratios.append(held / (layers * pool.num_used))
        peak = max(peak, _resident())
    out.put(
        {
            "window_memory": window_memory,
            "num_blocks": engine.num_blocks,
            "window_blocks": pool.window_blocks,
            "held_vs_full_paging_last": ratios[-1],
            "held_vs_full_paging_max": max(ratios),
            "resident_before_engine_mib": before / 2**20,
            "resident_built_mib": built / 2**20,
            "resident_peak_mib": peak / 2**20,
            "decode_step_ms_p50": statistics.median(steps[1:]) * 1e3,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/window_memory.json"))
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    runs: dict[str, list[dict[str, Any]]] = {"apart": [], "kept": []}
    for r in range(args.rounds):
        order = [True, False] if r % 2 == 0 else [False, True]
        for window_memory in order:
            queue = ctx.Queue()
            p = ctx.Process(target=measure, args=(window_memory, args.tokens, queue))
            p.start()
            result = queue.get(timeout=1800)
            p.join()
            runs["apart" if window_memory else "kept"].append(result)
            print(json.dumps(result), flush=True)
    apart, kept = runs["apart"][0], runs["kept"][0]
    report = {
        "benchmark": "window_memory",
        "model": "gemma3-270m (Q4_K_M GGUF, bf16)",
        "prompt_tokens": args.tokens,
        "output_tokens": OUTPUT_TOKENS,
        "kv_cache_memory_bytes": BUDGET,
        "host": host_description(),
        "torch": torch.__version__,
        "runs": runs,
        "held_vs_full_paging": apart["held_vs_full_paging_max"],
        "resident_peak_ratio": statistics.median(r["resident_peak_mib"] for r in runs["apart"])
        / statistics.median(r["resident_peak_mib"] for r in runs["kept"]),
        "blocks_per_budget_ratio": apart["num_blocks"] / kept["num_blocks"],
        "decode_step_ratio_p50": statistics.median(r["decode_step_ms_p50"] for r in runs["apart"])
        / statistics.median(r["decode_step_ms_p50"] for r in runs["kept"]),
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
