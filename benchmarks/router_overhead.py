"""What `pdserve router` adds to time to first token: one run, side by side.

A prefill and a decode node (the bundled model, fp32, one core each) and a router in front of
the decode (`--policy cache_aware`, the default), all on loopback. `pdserve bench serve` drives
the same workload (streaming completions, one at a time so queueing does not blur the hop)
straight at the decode entrance and through the router, alternating for `--rounds`; TTFT p50
of each, their ratio and the milliseconds added. Target (issue 13): <= 1.05x, or <= 5 ms added.

    .venv/bin/python benchmarks/router_overhead.py [--rounds 3] [--num-prompts 16]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.serve.launcher import free_port


def start(args: list[str], name: str, ready: str) -> subprocess.Popen[bytes]:
    log = Path(tempfile.mkstemp(prefix=f"router-overhead-{name}-", suffix=".log")[1])
    with open(log, "w") as out:
        cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", *args]
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not re.search(ready, log.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc


def bench(url: str, args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkstemp(prefix="router-overhead-", suffix=".json")[1])
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", url]
    cmd += ["--num-prompts", str(args.num_prompts), "--max-concurrency", "1", "--no-progress"]
    cmd += ["--input-len", str(args.input_len), "--output-len", "4", "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary: dict[str, Any] = json.loads(out.read_text())["summary"]
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--out", default="benchmarks/results/router_overhead.json")
    args = ap.parse_args()
    grpc, http, router_port = free_port(), free_port(), free_port()
    common = ["--dtype", "float32", "--threads", "1"]
    procs = []
    try:
        procs.append(start(["prefill", *common, "--port", str(grpc)], "prefill", "ready"))
        decode = ["serve", "--role", "decode", *common, "--port", str(http), "--grpc-port", "0"]
        decode += ["--transfer-port", "0", "--prefill", f"127.0.0.1:{grpc}"]
        procs.append(start(decode, "decode", "ready"))
        router = ["router", "--decode", f"http://127.0.0.1:{http}"]
        router += ["--prefill", f"127.0.0.1:{grpc}", "--port", str(router_port)]
        procs.append(start(router, "router", "router ready"))
        direct_url, routed_url = f"http://127.0.0.1:{http}", f"http://127.0.0.1:{router_port}"
        bench(direct_url, args)  # warm both paths once
        bench(routed_url, args)
        direct, routed = [], []
        for _ in range(args.rounds):
            direct.append(bench(direct_url, args)["ttft_ms"]["p50"])
            routed.append(bench(routed_url, args)["ttft_ms"]["p50"])
            print("direct", direct[-1], "routed", routed[-1], flush=True)
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(30)
    d, r = statistics.median(direct), statistics.median(routed)
    result = {
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": 4,
            "concurrency": 1,
            "rounds": args.rounds,
        },
        "ttft_p50_ms": {"direct": direct, "routed": routed},
        "median_direct_ms": d,
        "median_routed_ms": r,
        "ratio": r / d,
        "added_ms": r - d,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
