"""What the live correctness canary (`--canary-rate`) costs user requests: a colocated server
(`pdserve serve --role both`) without the canary, with it at rate 0.05 (the issue's setting)
and at 0.5 (a stress of its yielding), side by side in one run, rounds alternating the order.

Load per round (same seeds for every mode): 256-token prompts with 32 output tokens (greedy, so
every request may be drawn) arriving as a Poisson stream at 1.5 req/s, which leaves the idle
gaps in which checks run, and a check that is running when a request arrives is aborted
("yielded"). Reported per mode: TTFT and ITL p50/p99 over the rounds, the spread of the
canary-off rounds (the noise a difference is measured against), and the canary's checks by
outcome from the server's /metrics (so the JSON shows the checks did run).

    .venv/bin/python benchmarks/canary.py [--rounds 3] [--requests 48] [--rate 1.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import urllib.request
from pathlib import Path
from typing import Any

from disagg_vs_colocated import MODEL, Server, load

from pdserve.bench.dataset import random_prompts
from pdserve.bench.stats import summarize
from pdserve.model.isa import host_description

MODES = {"off": 0.0, "rate_0.05": 0.05, "rate_0.5": 0.5}


def canary_checks(url: str) -> dict[str, float]:
    """pdserve:canary_checks_total by result, from the server's /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdserve:canary_checks_total{"):
            labels, value = line.rsplit(" ", 1)
            result = labels.split('result="', 1)[1].split('"', 1)[0]
            out[result] = out.get(result, 0.0) + float(value)
    return out


def run_mode(rate: float, log_dir: Path, requests: int, arrivals: float) -> dict[str, Any]:
    extra = ("--canary-rate", str(rate)) if rate > 0 else ()
    server = Server("colocated", log_dir, extra=extra)
    try:
        prompts = random_prompts(requests, 256, 32, 0.0, seed=21)
        records, duration = asyncio.run(load(server.url, prompts, rate=arrivals, seed=22))
        summary = summarize(records, duration)
        return {
            "ttft_ms": summary["ttft_ms"],
            "itl_ms": summary["itl_ms"],
            "completed": summary["completed"],
            "failed": summary["failed"],
            "canary_checks": canary_checks(server.url),
        }
    finally:
        server.stop()


def compare(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each mode's medians over the rounds, as a ratio to canary-off, against off's spread."""

    def med(mode: str, metric: str, q: str) -> float:
        return statistics.median(r[metric][q] for r in runs[mode])

    out: dict[str, Any] = {}
    for metric in ("ttft_ms", "itl_ms"):
        for q in ("p50", "p99"):
            off = [r[metric][q] for r in runs["off"]]
            noise = (max(off) - min(off)) / statistics.median(off)
            out[f"{metric}_{q}"] = {
                "off_spread_over_rounds": noise,
                **{m: med(m, metric, q) / med("off", metric, q) for m in runs if m != "off"},
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=1.5, help="user requests per second")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    order = list(MODES)
    for round_ in range(args.rounds):
        for mode in order if round_ % 2 == 0 else order[::-1]:
            print(f"round {round_} {mode}", flush=True)
            runs[mode].append(run_mode(MODES[mode], out_dir, args.requests, args.rate))
    result = {
        "host": host_description(),
        "cores": os.cpu_count(),
        "model": MODEL,
        "load": {
            "requests": args.requests,
            "rate_per_s": args.rate,
            "prompt_tokens": 256,
            "output_tokens": 32,
            "temperature": 0.0,
        },  # fmt: skip
        "rounds": args.rounds,
        "ratios_to_off": compare(runs),
        "runs": runs,
    }
    path = out_dir / "canary.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["ratios_to_off"], indent=2))


if __name__ == "__main__":
    main()
