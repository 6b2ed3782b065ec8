"""Does a prompt step reuse the memory the last one freed when its temporaries are larger than
glibc's mmap threshold (32 MiB at most)? A random Llama of Llama 3.2 1B's layer shape (hidden
2,048, MLP 8,192, 32 heads, 8 KV heads; 8 layers, bf16, the bundled SmolLM2's tokenizer and
vocabulary) made here, prompts of 2,040 tokens (the
gate/up output alone 67 MB), the engine on a thread of its own as a node runs it, in processes
that keep freed memory as every pdserve process does (`keep_freed_memory`: thresholds, one
arena, then `keep_step_memory` once loaded) and as they did before (the thresholds alone, glibc's
arenas), alternating process by process (model/heap.py). Per step: wall time, the
kernel's minor page faults and system time (getrusage). The first step of each process warms up
and is left out.

    .venv/bin/python benchmarks/step_memory.py [--rounds 3] [--steps 6] [--out FILE]

Writes the JSON (with the CPU model, family and flags) before printing its medians.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import resource
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.config import default_cache_dir
from pdserve.model.fetch import resolve_model
from pdserve.model.isa import host_description

SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=8,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=4096,
    vocab_size=49152,  # SmolLM2's, whose tokenizer it takes
)
TOKENS = 2040


def make_model(out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, initializer_range=0.02, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    bundled = resolve_model("default", default_cache_dir(), "bfloat16")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled / name, out / name)
    return out


def measure(model_dir: str, keep_steps: bool, steps: int, out: Any) -> None:
    from pdserve.model import heap

    heap.keep_freed_memory()  # as every pdserve process does at its start
    if not keep_steps:  # as before keep_step_memory: the thresholds alone, glibc's arenas
        mallopt = heap.libc_mallopt()
        assert mallopt is not None and mallopt(heap.M_ARENA_MAX, 0) == 1
        heap._kept = False  # keep_step_memory then changes nothing

    from pdserve.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sequence import SamplingParams

    config = EngineConfig(
        dtype="bfloat16", num_threads=2, cache=CacheConfig(kv_cache_memory=1 << 30)
    )
    engine = LLMEngine(config, model_dir)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    rows: list[dict[str, float]] = []

    def run() -> None:  # on a thread of its own, as a node's engine (its own malloc arena)
        for _ in range(steps + 1):
            prompt = [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(TOKENS)]
            before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            engine.generate([prompt], params)
            wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
            rows.append(
                {
                    "wall_s": wall,
                    "minor_faults": after.ru_minflt - before.ru_minflt,
                    "system_s": after.ru_stime - before.ru_stime,
                }
            )

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    out.put(rows[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3, help="processes each way, alternating")
    ap.add_argument("--steps", type=int, default=6, help="timed prompt steps per process")
    ap.add_argument("--out", default="benchmarks/results/step_memory.json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    runs: dict[str, list[list[dict[str, float]]]] = {"keep_step_memory": [], "thresholds_only": []}
    with tempfile.TemporaryDirectory(prefix="step_memory-") as tmp:
        model_dir = str(make_model(Path(tmp) / "llama-1b-shape"))
        for i in range(2 * args.rounds):
            keep = i % 2 == (i // 2) % 2  # on/off, off/on, on/off, ...
            queue = ctx.Queue()
            proc = ctx.Process(target=measure, args=(model_dir, keep, args.steps, queue))
            proc.start()
            while proc.is_alive() and queue.empty():
                proc.join(1.0)
            if queue.empty():
                raise SystemExit(f"the measuring process failed (exit code {proc.exitcode})")
            rows = queue.get()
            proc.join()
            runs["keep_step_memory" if keep else "thresholds_only"].append(rows)
    medians = {
        name: {
            key: statistics.median(r[key] for rows in per for r in rows)
            for key in ("wall_s", "minor_faults", "system_s")
        }
        for name, per in runs.items()
    }
    result = {
        "host": host_description(),
        "model": {**SHAPE, "dtype": "bfloat16", "weights": "random"},
        "prompt_tokens": TOKENS,
        "rounds": args.rounds,
        "steps": args.steps,
        "runs": runs,
        "medians": medians,
        "wall_ratio": medians["keep_step_memory"]["wall_s"] / medians["thresholds_only"]["wall_s"],
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"medians": medians, "wall_ratio": result["wall_ratio"]}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
