"""Disaggregated vs colocated serving, side by side in one run, with `pdserve bench`'s client.

Modes: `colocated` is `pdserve serve --role both` with both cores; `disaggregated` is the
`pdserve serve` pair, prefill pinned to core 0 and decode to core 1. Each round starts one
mode, runs every workload against it (same seeds), stops it, then does the same for the other;
rounds alternate the order so drift shows.

Workloads:
  a  decode interference: a steady stream of short requests (64-token prompts, 48 output
     tokens) while 1024-2048-token prompts arrive; reported: the stream's inter-token latency.
  b  overhead: 2048-token prompts with 1 and with 16 output tokens at a low rate; TTFT.
  c  rate sweep: 256-token prompts, 32 output tokens, at increasing rates; TTFT and p99 ITL.

    .venv/bin/python benchmarks/disagg_vs_colocated.py [--rounds 2] [--scale 0.75] [--out DIR]
        [--transfer-backend tcp|nixl] [--workloads abc]

With `--transfer-backend nixl` the disaggregated pair moves KV through NIXL (UCX kept on
loopback and shared memory) and the JSON is written as disagg_vs_colocated-nixl.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.bench.client import LoadConfig, run_load
from pdserve.bench.dataset import random_prompts
from pdserve.bench.stats import RequestRecord, record_dict, summarize
from pdserve.serve.launcher import free_port

MODEL = "SmolLM2-135M-Instruct"


class Server:
    """`pdserve serve` (colocated: --role both) on a free port, healthy when constructed;
    `extra`: further flags."""

    def __init__(
        self, mode: str, log_dir: Path, backend: str = "tcp", extra: tuple[str, ...] = ()
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["--role", "both", "--threads", "2"] if mode == "colocated" else []
        args += ["--transfer-backend", backend] if mode == "disaggregated" else []
        args += list(extra)
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(self.port), *args]
        self.log = open(log_dir / f"{mode}-{self.port}.log", "w")  # noqa: SIM115
        env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{mode} server exited; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{mode} server not healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


async def load(
    url: str, prompts: list[Any], rate: float, seed: int
) -> tuple[list[RequestRecord], float]:
    return await run_load(
        LoadConfig(url, MODEL, request_rate=rate, seed=seed), prompts, progress=False
    )


async def workload_a(url: str, scale: float) -> dict[str, Any]:
    n_short, n_long = int(40 * scale), int(6 * scale)
    short = random_prompts(n_short, 64, 48, 0.0, seed=1)
    long = random_prompts(n_long, 1536, 8, 0.33, seed=2)
    (s_rec, s_dur), (l_rec, l_dur) = await asyncio.gather(
        load(url, short, rate=4.0, seed=3), load(url, long, rate=0.5, seed=4)
    )
    return {
        "stream": summarize(s_rec, s_dur),
        "long_prompts": summarize(l_rec, l_dur),
        "stream_itl_s": sorted(g for r in s_rec if r.ok for g in r.itl),
        "requests": [record_dict(r) for r in s_rec + l_rec],
    }


async def workload_b(url: str, scale: float) -> dict[str, Any]:
    out = {}
    for n_out in (1, 16):
        prompts = random_prompts(max(2, int(5 * scale)), 2048, n_out, 0.0, seed=10 + n_out)
        rec, dur = await load(url, prompts, rate=0.3, seed=5)
        out[f"output_{n_out}"] = {
            "summary": summarize(rec, dur),
            "requests": [record_dict(r) for r in rec],
        }
    return out


async def workload_c(url: str, scale: float, rates: list[float]) -> dict[str, Any]:
    out = {}
    for rate in rates:
        prompts = random_prompts(max(4, int(rate * 15 * scale)), 256, 32, 0.2, seed=int(rate * 100))
        rec, dur = await load(url, prompts, rate=rate, seed=7)
        out[str(rate)] = summarize(rec, dur)
    return out


def run_mode(
    mode: str, log_dir: Path, scale: float, rates: list[float], backend: str, workloads: str
) -> dict[str, Any]:
    server = Server(mode, log_dir, backend)
    out: dict[str, Any] = {}
    try:
        for name in workloads:
            print(f"[{mode}] workload {name}", flush=True)
            if name == "a":
                out["a"] = asyncio.run(workload_a(server.url, scale))
            elif name == "b":
                out["b"] = asyncio.run(workload_b(server.url, scale))
            else:
                out["c"] = asyncio.run(workload_c(server.url, scale, rates))
    finally:
        server.stop()
    return out


def ratios(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    d, c = runs["disaggregated"], runs["colocated"]
    out: dict[str, Any] = {
        "targets": {"a": "<= 0.5", "b_16_out": "<= 1.15", "exposed_transfer": "<= 0.10"}
    }
    if "a" in d[0]:
        itl = [[r["a"]["stream"]["itl_ms"]["p99"] for r in rs] for rs in (d, c)]
        out["a_stream_itl_p99_disagg_over_colocated"] = mean(itl[0]) / mean(itl[1])
    if "b" not in d[0]:
        return out
    ttft_16 = (
        [r["b"]["output_16"]["summary"]["ttft_ms"]["p50"] for r in d],
        [r["b"]["output_16"]["summary"]["ttft_ms"]["p50"] for r in c],
    )
    ttft_1 = (
        [r["b"]["output_1"]["summary"]["ttft_ms"]["p50"] for r in d],
        [r["b"]["output_1"]["summary"]["ttft_ms"]["p50"] for r in c],
    )
    exposed = [
        req["timing"]["exposed_transfer"] / req["timing"]["ttft"]
        for r in d
        for req in r["b"]["output_16"]["requests"]
        if req.get("timing") and req["timing"].get("ttft")
    ]
    out["b_ttft_p50_16_out_disagg_over_colocated"] = mean(ttft_16[0]) / mean(ttft_16[1])
    out["b_ttft_p50_1_out_disagg_over_colocated"] = mean(ttft_1[0]) / mean(ttft_1[1])
    out["b_exposed_transfer_share_of_ttft_2048"] = mean(exposed) if exposed else None
    return out


def plot(runs: dict[str, list[dict[str, Any]]], rates: list[float], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: list[str] = []
    if any(w not in rs[0] for rs in runs.values() for w in "ac"):
        return files  # the plots show workloads a and c
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, rs in runs.items():
        itl = sorted(g * 1e3 for r in rs for g in r["a"]["stream_itl_s"])
        if itl:
            ax.plot(itl, [i / len(itl) for i in range(1, len(itl) + 1)], label=mode)
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("CDF")
    ax.set_title("Workload a: decode stream while long prompts arrive")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "disagg_itl_cdf.png", dpi=120)
    files.append("disagg_itl_cdf.png")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, rs in runs.items():
        ttft = [sum(r["c"][str(x)]["ttft_ms"]["p50"] for r in rs) / len(rs) for x in rates]
        itl = [sum(r["c"][str(x)]["itl_ms"]["p99"] for r in rs) / len(rs) for x in rates]
        ax1.plot(rates, ttft, marker="o", label=mode)
        ax2.plot(rates, itl, marker="o", label=mode)
    ax1.set_xlabel("request rate (req/s)")
    ax1.set_ylabel("TTFT p50 (ms)")
    ax2.set_xlabel("request rate (req/s)")
    ax2.set_ylabel("ITL p99 (ms)")
    ax1.legend()
    fig.suptitle("Workload c: rate sweep")
    fig.tight_layout()
    fig.savefig(out_dir / "disagg_rate_sweep.png", dpi=120)
    files.append("disagg_rate_sweep.png")
    return files


def without_gaps(run: dict[str, Any]) -> dict[str, Any]:
    """The JSON keeps summaries, not every inter-token gap."""
    if "a" not in run:
        return run
    return {**run, "a": {k: v for k, v in run["a"].items() if k != "stream_itl_s"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of both modes")
    ap.add_argument("--scale", type=float, default=0.75, help="multiplies request counts")
    ap.add_argument("--rates", default="0.5,1,2")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--transfer-backend", default="tcp", choices=["tcp", "nixl"])
    ap.add_argument("--workloads", default="abc", help="which of a, b, c to run")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = [float(x) for x in args.rates.split(",")]
    runs: dict[str, list[dict[str, Any]]] = {"colocated": [], "disaggregated": []}
    order = ["colocated", "disaggregated"]
    for round_ in range(args.rounds):
        for mode in order if round_ % 2 == 0 else order[::-1]:
            runs[mode].append(
                run_mode(mode, out_dir, args.scale, rates, args.transfer_backend, args.workloads)
            )
    slim = {mode: [without_gaps(r) for r in rs] for mode, rs in runs.items()}
    result: dict[str, Any] = {
        "machine": {"cores": os.cpu_count()},
        "model": MODEL,
        "transfer_backend": args.transfer_backend,
        "workloads": args.workloads,
        "ratios": ratios(runs),
        "runs": slim,
        "plots": [],
    }
    suffix = "" if args.transfer_backend == "tcp" else f"-{args.transfer_backend}"
    path = out_dir / f"disagg_vs_colocated{suffix}.json"
    path.write_text(json.dumps(result, indent=2, default=str))  # before plotting: kept whatever
    print(json.dumps(result["ratios"], indent=2))
    result["plots"] = plot(runs, rates, out_dir)
    path.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
