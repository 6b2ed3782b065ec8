"""Drain under load: a decode taken out of a 2-prefill, 2-decode fleet while 4 clients stream.

The bundled model (fp32, one thread per node) on 2 prefill and 2 decode nodes behind
`pdserve router`, all on loopback. 4 clients stream greedy completions back to back (random
prompts of 32-300 tokens, 32-160 output tokens) for `--seconds`; at a third of the run
`pdserve drain` takes decode 0 out (its streams move to decode 1, the rest are waited for),
then decode 0 gets SIGTERM. Checked and written as JSON (before anything else can fail):
  - failed requests (a status other than 200, an error event, a stream cut short): 0;
  - the drained decode holds no KV block (its gRPC `GetStats`) before it stops, and exits 0;
  - every completed stream's text equals the same request answered undisturbed afterwards.

    .venv/bin/python benchmarks/drain.py [--seconds 60] [--out benchmarks/results/drain.json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.model.isa import host_description

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import free_port  # noqa: E402  (a sibling script)

MODEL = "smollm2"
CLIENTS = 4


class Proc:
    def __init__(self, args: list[str], name: str) -> None:
        self.name = name
        self.log = Path(tempfile.mkstemp(prefix=f"pdserve-drain-{name}-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "INFO", *args]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def wait_for(self, pattern: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, self.log.read_text()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no {pattern!r}:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class Fleet:
    def __init__(self) -> None:
        self.procs: list[Proc] = []
        common = ["--dtype", "float32", "--threads", "1"]
        self.prefills = [f"127.0.0.1:{free_port()}" for _ in range(2)]
        self.decodes = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        self.decode_grpc = [f"127.0.0.1:{free_port()}" for _ in range(2)]
        self.router = f"http://127.0.0.1:{free_port()}"
        for i, address in enumerate(self.prefills):
            port = address.rsplit(":", 1)[1]
            self.procs.append(Proc(["prefill", *common, "--port", port], f"prefill{i}"))
        peers = [a for p in self.prefills for a in ("--prefill", p)]
        for i, (url, grpc_address) in enumerate(zip(self.decodes, self.decode_grpc, strict=True)):
            args = ["serve", "--role", "decode", *common, "--port", url.rsplit(":", 1)[1]]
            args += ["--grpc-port", grpc_address.rsplit(":", 1)[1], "--transfer-port", "0"]
            args += ["--min-prefill-tokens", "1", "--served-model-name", MODEL, *peers]
            self.procs.append(Proc(args, f"decode{i}"))
        for p in self.procs:
            p.wait_for("ready")
        decodes = [a for u in self.decodes for a in ("--decode", u)]
        router = ["router", *decodes, *peers, "--port", self.router.rsplit(":", 1)[1]]
        self.procs.append(Proc([*router, "--policy", "least_loaded"], "router"))
        self.procs[-1].wait_for("router ready")

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def stream(url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion: its text, whether it completed, and why not."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    text, finished, error = "", None, None
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {r.read()[:300]!r}"}
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"].get("message")
                    break
                choice = event["choices"][0]
                text += choice.get("text", "")
                finished = choice.get("finish_reason") or finished
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    ok = error is None and finished == "length"
    return {"ok": ok, "text": text, "error": error or (None if ok else "cut short")}


def run(seconds: float, seed: int) -> dict[str, Any]:
    fleet = Fleet()
    rng = random.Random(seed)
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds
    report: dict[str, Any] = {"host": host_description(), "seconds": seconds}
    try:

        def client(k: int) -> None:
            local = random.Random(seed * 100 + k)
            while time.monotonic() < end:
                prompt = [local.randrange(1000, 20000) for _ in range(local.randint(32, 300))]
                max_tokens = local.randint(32, 160)
                started = time.monotonic()
                out = stream(fleet.router, prompt, max_tokens)
                out.update(prompt=prompt, max_tokens=max_tokens, started=started)
                with lock:
                    results.append(out)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
        for t in threads:
            t.start()
        time.sleep(seconds / 3)
        drained_at = time.monotonic()
        drain = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "drain", "--router", fleet.router,
             "--decode", fleet.decodes[0], "--timeout", "60"],  # fmt: skip
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        report["drain"] = {
            "exit": drain.returncode,
            "output": drain.stdout.strip()[-500:],
            "took_s": round(time.monotonic() - drained_at, 2),
        }
        stats = pb_grpc.DecodeServiceStub(grpc.insecure_channel(fleet.decode_grpc[0])).GetStats(
            pb.StatsRequest(), timeout=10
        )
        report["drained_decode"] = {
            "blocks_held": stats.num_blocks - stats.num_free_blocks,
            "requests": stats.num_requests,
        }
        report["drained_decode"]["exit"] = fleet.procs[2].stop()
        for t in threads:
            t.join()
        failed = [r for r in results if not r["ok"]]
        report["requests"] = len(results)
        report["failed"] = len(failed)
        report["failures"] = [r["error"] for r in failed][:20]
        report["after_drain"] = sum(1 for r in results if r["started"] > drained_at)
        # Undisturbed: each completed request again, on the decode left, one at a time.
        done = [r for r in results if r["ok"]]
        sample = rng.sample(done, min(len(done), 24))
        differ = [
            i for i, r in enumerate(sample)
            if stream(fleet.decodes[1], r["prompt"], r["max_tokens"])["text"] != r["text"]
        ]  # fmt: skip
        report["checked_against_undisturbed"] = len(sample)
        report["differ_from_undisturbed"] = len(differ)
    finally:
        fleet.stop()
    report["pass"] = (
        report.get("failed") == 0
        and report.get("drained_decode", {}).get("blocks_held") == 0
        and report.get("drained_decode", {}).get("exit") == 0
        and report.get("differ_from_undisturbed") == 0
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/drain.json")
    args = parser.parse_args()
    report = run(args.seconds, args.seed)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "host"}, indent=2))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
