"""Soak: a real prefill + decode pair under concurrent load and faults, checked afterwards.

Requests (random prompt and output lengths, greedy) arrive at a rate that keeps both nodes
busy; a fifth of the clients cancel at a random point (before the call lands, while the prompt
transfers, after some tokens). In the middle, prefill is SIGSTOPped for 3 s, and later SIGKILLed
and restarted on the same port. Afterwards:
  - every completed request's tokens equal the colocated engine's for the same prompt;
  - every failed request failed within its deadline + 1 s, with a status and a message;
  - both nodes are back to every block free, an empty resource store and side channel, no
    transfer pending, and their thread count at its baseline.

    .venv/bin/python benchmarks/soak.py [--requests 1000] [--rate 4] [--out FILE.json]

`tests/disagg/test_soak.py` runs a short version in the test suite. The report is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.serve.launcher import free_port

READY_TIMEOUT_S = 300
DEADLINE_SLACK_S = 1.0
VOCAB_LOW, VOCAB_HIGH = 1000, 20000  # token ids drawn for random prompts


class Node:
    """One `pdserve prefill|decode` process on 127.0.0.1, always stopped by its owner."""

    def __init__(self, role: str, args: list[str], port: int | None = None) -> None:
        self.role = role
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix=f"pdserve-soak-{role}-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "INFO", role,
               "--dtype", "float32", "--threads", "1", "--port", str(self.port), *args]  # fmt: skip
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "ready grpc=" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.role} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Outcome:
    index: int
    prompt_len: int
    max_tokens: int
    cancel: str | None  # None, "before", "during", "after"
    tokens: list[int] = field(default_factory=list)
    status: str = ""  # "ok", "cancelled" or the gRPC status name of a failure
    message: str = ""
    started: float = 0.0
    ended: float = 0.0
    timeout_s: float = 0.0


def one_request(
    stub: pb_grpc.DecodeServiceStub, o: Outcome, prompt: list[int], rng: random.Random
) -> Outcome:
    sampling = pb.SamplingConfig(max_tokens=o.max_tokens, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=prompt, sampling=sampling, timeout_s=o.timeout_s)
    o.started = time.monotonic()
    call = stub.Generate(request, timeout=o.timeout_s + 10)
    cancel_after = {"before": 0, "during": 0, "after": rng.randint(1, max(1, o.max_tokens - 1))}
    if o.cancel == "before":
        call.cancel()
    elif o.cancel == "during":
        threading.Timer(rng.uniform(0.05, 1.0), call.cancel).start()
    try:
        for response in call:
            o.tokens.extend(response.token_ids)
            if o.cancel == "after" and len(o.tokens) >= cancel_after["after"]:
                call.cancel()
        o.status = "ok"
    except grpc.RpcError as e:
        cancelled = e.code() == grpc.StatusCode.CANCELLED and o.cancel is not None
        o.status = "cancelled" if cancelled else e.code().name
        o.message = e.details() or ""
    o.ended = time.monotonic()
    return o


def node_clean(stub: Any, baseline_threads: int) -> dict[str, Any]:
    s = stub.GetStats(pb.StatsRequest(), timeout=5)
    return {
        "free": s.num_free_blocks == s.num_blocks,
        "store_empty": s.resource_store_entries == 0 and s.side_channel_entries == 0,
        "no_pending": s.pending_tasks == 0 and s.num_requests == 0,
        "threads_at_baseline": s.threads <= baseline_threads,
        "threads": s.threads,
        "baseline_threads": baseline_threads,
    }


def wait_clean(stub: Any, baseline_threads: int, within_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    state = node_clean(stub, baseline_threads)
    while not all(v for k, v in state.items() if isinstance(v, bool)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
        state = node_clean(stub, baseline_threads)
    return state


def colocated_reference(prompts: list[tuple[list[int], int]]) -> list[list[int]]:
    """The colocated engine's greedy tokens for each (prompt, max_tokens), all in one batch."""
    from pdserve.config import CacheConfig, EngineConfig, default_cache_dir
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sequence import SamplingParams
    from pdserve.model.fetch import resolve_model

    model_dir = resolve_model("default", default_cache_dir(), "float32")
    config = EngineConfig(dtype="float32", num_threads=2, cache=CacheConfig(num_blocks=2048))
    engine = LLMEngine(config, model_dir)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in prompts]
    return [o.token_ids for o in engine.generate([p for p, _ in prompts], params)]


def run_soak(num_requests: int, rate: float, seed: int = 0, timeout_s: float = 20.0) -> dict:
    rng = random.Random(seed)
    prompts = [
        ([rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(16, 128))],
         rng.randint(4, 16))
        for _ in range(num_requests)
    ]  # fmt: skip
    cancels = [rng.choice(["before", "during", "after"]) if rng.random() < 0.2 else None
               for _ in range(num_requests)]  # fmt: skip
    # Every frame checksummed and verified: a false alarm would fail a request and show here.
    prefill = Node("prefill", ["--kv-checksum"])
    decode = Node("decode", ["--kv-checksum", "--prefill", prefill.address,
                             "--request-timeout", str(timeout_s)])  # fmt: skip
    nodes = [prefill, decode]
    logs = [n.log for n in nodes]  # every node's, the killed prefill's too
    faults: list[dict[str, Any]] = []
    try:
        for n in nodes:
            n.wait_ready()
        d = pb_grpc.DecodeServiceStub(grpc.insecure_channel(decode.address))
        p_channel = grpc.insecure_channel(prefill.address)
        p = pb_grpc.PrefillServiceStub(p_channel)
        warm = Outcome(-1, 64, 4, None, timeout_s=timeout_s)  # links and their threads exist
        one_request(d, warm, list(range(VOCAB_LOW, VOCAB_LOW + 64)), rng)
        assert warm.status == "ok", warm
        base = (d.GetStats(pb.StatsRequest()).threads, p.GetStats(pb.StatsRequest()).threads)
        stall_at, kill_at = num_requests // 3, 2 * num_requests // 3
        futures: list[Future[Outcome]] = []
        start = time.monotonic()
        with ThreadPoolExecutor(32) as pool:
            for i, ((prompt, n), cancel) in enumerate(zip(prompts, cancels, strict=True)):
                o = Outcome(i, len(prompt), n, cancel, timeout_s=timeout_s)
                futures.append(pool.submit(one_request, d, o, prompt, random.Random(seed + i)))
                if i == stall_at:
                    prefill.signal(signal.SIGSTOP)
                    faults.append({"fault": "SIGSTOP prefill 3 s", "at_request": i})
                    threading.Timer(3.0, prefill.signal, (signal.SIGCONT,)).start()
                if i == kill_at:
                    prefill.signal(signal.SIGCONT)
                    prefill.proc.kill()
                    prefill.proc.wait()
                    faults.append({"fault": "SIGKILL prefill + restart", "at_request": i})
                    prefill = nodes[0] = Node("prefill", ["--kv-checksum"], port=prefill.port)
                    logs.append(prefill.log)
                    prefill.wait_ready()
                    p_channel.close()
                    p_channel = grpc.insecure_channel(prefill.address)
                    p = pb_grpc.PrefillServiceStub(p_channel)
                time.sleep(rng.expovariate(rate))
            outcomes = [f.result() for f in futures]
        elapsed = time.monotonic() - start
        decode_state = wait_clean(d, base[0])
        checksum_failures = d.GetStats(pb.StatsRequest()).kv_checksum_failures
        prefill_state = wait_clean(p, base[1])  # the restarted process runs the same threads
    finally:
        for n in nodes:
            n.stop()
    reference = colocated_reference(prompts)
    completed = [o for o in outcomes if o.status == "ok"]
    failed = [o for o in outcomes if o.status not in ("ok", "cancelled")]
    mismatched = [o.index for o in completed if o.tokens != reference[o.index]]
    late = [o.index for o in failed if o.ended - o.started > o.timeout_s + DEADLINE_SLACK_S]
    unexplained = [o.index for o in failed if not o.message]
    report = {
        "requests": num_requests,
        "rate": rate,
        "seconds": round(elapsed, 1),
        "completed": len(completed),
        "cancelled_by_client": sum(o.status == "cancelled" for o in outcomes),
        "cancels_planned": sum(c is not None for c in cancels),
        "failed": len(failed),
        "failures_by_status": {
            s: sum(o.status == s for o in failed) for s in {o.status for o in failed}
        },
        "faults": faults,
        "mismatched_outputs": mismatched,
        "failed_late": late,
        "failed_without_reason": unexplained,
        "kv_checksum_failures": checksum_failures,
        "decode_after": decode_state,
        "prefill_after": prefill_state,
        "outcomes": [asdict(o) | {"tokens": len(o.tokens)} for o in outcomes],
    }
    report["passed"] = (
        not mismatched and not late and not unexplained and bool(completed)
        and checksum_failures == 0
        and all(v for k, v in decode_state.items() if isinstance(v, bool))
        and all(v for k, v in prefill_state.items() if isinstance(v, bool))
    )  # fmt: skip
    # The nodes' logs are removed when the soak passed with no request failed, and named in the
    # report when not (a request failed past a fault is what the next reader wants them for).
    keep = not report["passed"] or bool(failed)
    for log in logs:
        if not keep:
            log.unlink(missing_ok=True)
    report["logs"] = [str(log) for log in logs] if keep else []
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/soak.json")
    args = parser.parse_args()
    report = run_soak(args.requests, args.rate, args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "outcomes"}, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
