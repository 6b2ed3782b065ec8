"""What OpenTelemetry tracing costs: the disaggregated pair (`pdserve serve`: a prefill and a
decode process) without tracing and with it on at sampling 1.0 (every request traced; its
spans exported over OTLP/HTTP to a receiver this script runs, which counts them), side by side
in one run, the order of the modes alternating every round.

Load per round (the same seeds for both modes): `--requests` 256-token prompts with 32 output
tokens, 4 in flight at a time. Reported per mode: output tok/s, TTFT and ITL p50/p99 (medians
over the rounds), on's ratio to off, off's own spread between rounds (the noise a difference
is read against) and the spans the receiver got (so the JSON shows tracing did run).

    .venv/bin/python benchmarks/tracing_overhead.py [--rounds 3] [--requests 24]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
from pathlib import Path
from typing import Any

from disagg_vs_colocated import MODEL, Server

from pdserve.bench.client import LoadConfig, run_load
from pdserve.bench.dataset import random_prompts
from pdserve.bench.otlp import SpanReceiver
from pdserve.bench.stats import summarize
from pdserve.model.isa import host_description


def run_mode(on: bool, sink: SpanReceiver, log_dir: Path, requests: int) -> dict[str, Any]:
    extra = ("--otlp-traces-endpoint", sink.url) if on else ()
    server = Server("disaggregated", log_dir, extra=extra)
    before = len(sink.spans)
    try:
        prompts = random_prompts(requests, 256, 32, 0.0, seed=31)
        config = LoadConfig(server.url, MODEL, max_concurrency=4, seed=32)
        records, duration = asyncio.run(run_load(config, prompts, progress=False))
        summary = summarize(records, duration)
    finally:
        server.stop()  # flushes the spans still queued
    return {
        "output_tok_s": summary["output_token_throughput"],
        "ttft_ms": summary["ttft_ms"],
        "itl_ms": summary["itl_ms"],
        "completed": summary["completed"],
        "failed": summary["failed"],
        "spans_received": len(sink.spans) - before,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    sink = SpanReceiver()
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for round_ in range(args.rounds):
        for mode in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
            print(f"round {round_} tracing {mode}", flush=True)
            runs[mode].append(run_mode(mode == "on", sink, out_dir, args.requests))

    def med(mode: str, metric: str, q: str | None = None) -> float:
        return statistics.median(r[metric] if q is None else r[metric][q] for r in runs[mode])

    off_tok = [r["output_tok_s"] for r in runs["off"]]
    ratios = {"output_tok_s": med("on", "output_tok_s") / med("off", "output_tok_s")}
    for metric in ("ttft_ms", "itl_ms"):
        for q in ("p50", "p99"):
            ratios[f"{metric}_{q}"] = med("on", metric, q) / med("off", metric, q)
    result = {
        "host": host_description(),
        "cores": os.cpu_count(),
        "model": MODEL,
        "load": {
            "requests": args.requests,
            "prompt_tokens": 256,
            "output_tokens": 32,
            "concurrency": 4,
            "sampling": 1.0,
        },  # fmt: skip
        "rounds": args.rounds,
        "on_over_off": ratios,
        "off_tok_s_spread_over_rounds": (max(off_tok) - min(off_tok)) / statistics.median(off_tok),
        "runs": runs,
    }
    path = out_dir / "tracing_overhead.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps(ratios, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
