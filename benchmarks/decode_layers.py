"""Decode speed with a step's layers in one compiled call (csrc/decode_layers.cpp) vs the same
engine running its Python layers, side by side in one process: SmolLM2-135M, bf16 and int4,
batches of 1, 4 and 8 sequences, greedy, ignore_eos. The two paths alternate for `--rounds`
rounds on the same engine (same weights, same kernels for the matmuls); decode tok/s counts the
tokens after each sequence's first over the time after the first.

    .venv/bin/python benchmarks/decode_layers.py [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def decode_tok_s(engine: Any, ids: list[int], batch: int, tokens: int) -> float:
    from pdserve.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", ids, params)
    first: float | None = None
    finished = 0
    while finished < batch:
        for o in engine.step():
            if first is None and o.token_ids:
                first = time.perf_counter()
            finished += o.finished
    assert first is not None
    return batch * tokens / (time.perf_counter() - first)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "decode_layers.json")
    args = ap.parse_args()
    from pdserve.config import CacheConfig, EngineConfig, default_cache_dir
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.model.fetch import resolve_model

    model_dir = resolve_model("default", default_cache_dir(), "bfloat16")
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[str, Any] = {}
    for quantization in ("none", "int4"):
        config = EngineConfig(
            dtype="bfloat16", num_threads=args.threads, quantization=quantization,
            cache=CacheConfig(num_blocks=512),
        )  # fmt: skip
        engine = LLMEngine(config, model_dir)
        fused = engine.model.fused_decode
        if fused is None:
            print("the compiled decode layers are not in use on this machine", file=sys.stderr)
            return 2
        ids = engine.tokenizer.encode(PROMPT)
        decode_tok_s(engine, ids, 1, 4)  # warm up
        for batch in batches:
            runs: dict[str, list[float]] = {"one call": [], "python layers": []}
            for _ in range(args.rounds):
                for path in runs:
                    engine.model.fused_decode = fused if path == "one call" else None
                    runs[path].append(decode_tok_s(engine, ids, batch, args.tokens))
            engine.model.fused_decode = fused
            median = {path: statistics.median(r) for path, r in runs.items()}
            key = f"{'bf16' if quantization == 'none' else quantization} batch {batch}"
            results[key] = {
                "runs": runs,
                "median_tok_s": median,
                "ratio": median["one call"] / median["python layers"],
            }
            print(f"{key}: {median} ({results[key]['ratio']:.2f}x)", flush=True)
        del engine
    out = {
        "machine": {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine()},
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized), bf16",
        "prompt": PROMPT,
        "tokens": args.tokens,
        "threads": args.threads,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
