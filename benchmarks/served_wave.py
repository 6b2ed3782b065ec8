"""Does serving slow a prompt wave down? The vs_vllm table load's wave (4 prompts of 542 token
ids at once) with one output token each, served by `pdserve serve --role both` (each request
over its own connection, the server's own `prefill_compute` read from its access log) and run
by `LLMEngine.generate` in this process (the same model, dtype and threads), alternating wave by
wave, fresh prompts every wave (no prefix hits). If the server's `prefill_compute` matches the
offline wave, a served TTFT is the wave's compute and only faster kernels shorten it.

    .venv/bin/python benchmarks/served_wave.py [--waves 8] [--out FILE]

Writes the JSON (with the CPU model, family and flags) before printing its medians.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import vs_vllm

from pdserve.config import EngineConfig, default_cache_dir
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from pdserve.model.fetch import resolve_model
from pdserve.model.heap import keep_freed_memory
from pdserve.model.isa import host_description

PROMPTS, TOKENS = 4, 542
SYSTEM = "pdserve-colocated-bf16"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--waves", type=int, default=8, help="timed waves each way")
    ap.add_argument("--out", default="benchmarks/results/served_wave.json")
    args = ap.parse_args()
    rng = random.Random(5)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(1000, 40000) for _ in range(TOKENS)] for _ in range(PROMPTS)]

    logs = Path(tempfile.mkdtemp(prefix="served_wave-"))  # the server's log, kept for a look
    server = vs_vllm.Server(SYSTEM, Path(), Path(), logs)
    try:
        server.wait_ready(300)

        def served(batch: list[list[int]]) -> float:
            def one(prompt: list[int]) -> None:
                body = {"model": vs_vllm.MODEL, "prompt": prompt, "max_tokens": 1,
                        "ignore_eos": True, "temperature": 0}  # fmt: skip
                r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text

            threads = [threading.Thread(target=one, args=(p,)) for p in batch]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return time.perf_counter() - start

        keep_freed_memory()  # as a pdserve process does
        model = resolve_model("default", default_cache_dir(), "bfloat16")
        engine = LLMEngine(EngineConfig(dtype="bfloat16", num_threads=2), model)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        def offline(batch: list[list[int]]) -> float:
            start = time.perf_counter()
            engine.generate(batch, params)
            return time.perf_counter() - start

        for _ in range(2):  # warm up both
            served(prompts())
            offline(prompts())
        walls: dict[str, list[float]] = {"served": [], "offline": []}
        runs = {"served": served, "offline": offline}
        for i in range(2 * args.waves):
            for name in ("served", "offline") if i % 2 == 0 else ("offline", "served"):
                if len(walls[name]) < args.waves:
                    walls[name].append(runs[name](prompts()))
    finally:
        server.stop()
    text = server.log_path.read_text()
    computes = [float(x) for x in re.findall(r"'prefill_compute': ([0-9.]+)", text)]
    timed = computes[-PROMPTS * args.waves :]  # the timed waves' requests, after the warm-up
    result: dict[str, Any] = {
        "host": host_description(),
        "load": {"prompts": PROMPTS, "tokens": TOKENS, "output_tokens": 1, "waves": args.waves},
        "served_client_wall_ms": [w * 1e3 for w in walls["served"]],
        "served_prefill_compute_ms": [c * 1e3 for c in timed],
        "offline_wave_ms": [w * 1e3 for w in walls["offline"]],
    }
    result["medians_ms"] = {
        key: statistics.median(result[key])
        for key in ("served_client_wall_ms", "served_prefill_compute_ms", "offline_wave_ms")
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["medians_ms"], indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
