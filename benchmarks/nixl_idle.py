"""Idle CPU of a node with the NIXL transfer backend loaded, against the same nodes on TCP.

For each backend a real prefill + decode pair (`pdserve prefill` / `pdserve decode`, the
bundled model, loopback only) serves a few disaggregated requests, so the agents are connected
and have moved KV, then sits idle; each process's CPU time (user + system, from /proc) is read
over `--seconds`. The NIXL target: at most 2% of one core per node while idle.

    .venv/bin/python benchmarks/nixl_idle.py [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.serve.launcher import free_port

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def start(role: str, args: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
    log = Path(tempfile.mkstemp(prefix=f"nixl-idle-{role}-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "pdserve.cli", role, "--dtype", "float32", "--threads", "1"]
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([*cmd, *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, log


def wait_ready(proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 300
    while "ready grpc=" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"node did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)


def measure(backend: str, seconds: float) -> dict[str, float]:
    p_port, d_port = free_port(), free_port()
    both = ["--transfer-backend", backend]
    prefill = start("prefill", [*both, "--port", str(p_port)])
    decode = start("decode", [*both, "--port", str(d_port), "--prefill", f"127.0.0.1:{p_port}"])
    try:
        for proc, log in (prefill, decode):
            wait_ready(proc, log)
        stub = pb_grpc.DecodeServiceStub(grpc.insecure_channel(f"127.0.0.1:{d_port}"))
        sampling = pb.SamplingConfig(max_tokens=4, temperature=0.0, ignore_eos=True)
        for i in range(3):
            ids = list(range(1000 + i, 1200 + i))
            out = list(stub.Generate(pb.GenerateRequest(token_ids=ids, sampling=sampling)))
            assert out[0].remote_prefill, "the request was not disaggregated"
        time.sleep(2.0)  # let the last request's work settle
        pids = {"prefill": prefill[0].pid, "decode": decode[0].pid}
        before = {k: cpu_seconds(pid) for k, pid in pids.items()}
        time.sleep(seconds)
        return {
            f"{k}_idle_core_percent": 100 * (cpu_seconds(pid) - before[k]) / seconds
            for k, pid in pids.items()
        }
    finally:
        for proc, _ in (prefill, decode):
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", default="benchmarks/results/nixl_idle.json")
    args = ap.parse_args()
    results = {backend: measure(backend, args.seconds) for backend in ("tcp", "nixl")}
    out = {"seconds": args.seconds, "target_core_percent": 2.0, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
