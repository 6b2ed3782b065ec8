"""Why the served engine ran slower than the offline one, and that it no longer does.

torch's CPU kernels run on libgomp. Every thread that enters a parallel region gets a libgomp
thread pool of its own, and libgomp spins between regions only while the threads it manages do
not outnumber the cores; past that it sleeps on a futex after each region and must be woken for
the next. `pdserve serve` used to load the engine on an executor thread (which stays alive with
its pool) and step it on the engine thread: two pools, so every parallel region of every decode
step ended in futex sleeps. Now the engine thread builds the engine and steps it.

Part 1, the same decode work (4 sequences, ~542-token contexts, 48 tokens each) in a fresh
process per layout, side by side:
  main          - load and step on the main thread (the offline `LLMEngine.generate` layout)
  two-threads   - load on an executor thread that stays alive, step on another thread (the old
                  served layout)
  engine-thread - pdserve's `EngineThread`: built and stepped on its own thread (the served
                  layout now)
For each: the median decode step (ms) and the stepping thread's voluntary context switches.

Part 2, served vs offline on one workload: `pdserve serve --role both` driven by
`pdserve bench serve` (N prompts, 4 concurrent, fixed input and output lengths, ignore_eos)
against the engine stepped offline with the same shape. Output tokens/s of each and the ratio.

    .venv/bin/python benchmarks/engine_thread.py [--dtype float32] [--num-prompts 8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pdserve.serve.launcher import free_port

LAYOUTS = ["main", "two-threads", "engine-thread"]
DECODE_SEQS, CONTEXT, DECODE_TOKENS = 4, 542, 48


def make_engine(dtype: str) -> Any:
    from pdserve.config import CacheConfig, EngineConfig, default_cache_dir
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.model.fetch import resolve_model

    model_dir = resolve_model("default", default_cache_dir(), dtype)
    config = EngineConfig(dtype=dtype, num_threads=2, cache=CacheConfig(kv_cache_memory=512 << 20))
    return LLMEngine(config, model_dir)


def decode_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 49000) for _ in range(CONTEXT)] for _ in range(DECODE_SEQS)]


def decode_run(engine: Any) -> dict[str, float]:
    """Prefill the prompts, then time each decode step; on the calling thread."""
    from pdserve.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(decode_prompts()):
        engine.add_request(f"d{i}", p, params)
    engine.step()  # the prefill (all prompts fit one step's budget)
    before = resource.getrusage(resource.RUSAGE_THREAD)
    steps = []
    while engine.has_compute():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    after = resource.getrusage(resource.RUSAGE_THREAD)
    steps.sort()
    return {
        "decode_step_ms_p50": 1000 * steps[len(steps) // 2],
        "decode_steps": len(steps),
        "voluntary_ctx_switches": after.ru_nvcsw - before.ru_nvcsw,
        "involuntary_ctx_switches": after.ru_nivcsw - before.ru_nivcsw,
    }


def run_layout(layout: str, dtype: str) -> dict[str, float]:
    if layout == "main":
        return decode_run(make_engine(dtype))
    if layout == "two-threads":
        loader = ThreadPoolExecutor(1)  # kept alive, as an event loop's default executor is
        engine = loader.submit(make_engine, dtype).result()
        with ThreadPoolExecutor(1) as stepper:
            return stepper.submit(decode_run, engine).result()
    from pdserve.engine.engine_thread import EngineThread

    thread = EngineThread(lambda: make_engine(dtype), "engine")
    thread.build().result()
    thread.start()
    try:
        return thread.call(lambda: decode_run(thread.engine)).result()
    finally:
        thread.stop()


def served(dtype: str, n: int, input_len: int, output_len: int) -> dict[str, Any]:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="engine-thread-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--role", "both", "--dtype", dtype]
    cmd += ["--port", str(port), "--grpc-port", "0", "--transfer-port", "0"]
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError as e:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start:\n{log.read_text()[-2000:]}") from e
                time.sleep(0.5)
        result = Path(tempfile.mkstemp(prefix="engine-thread-bench-", suffix=".json")[1])
        bench = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--no-progress"]
        bench += ["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(n)]
        bench += ["--max-concurrency", "4", "--input-len", str(input_len)]
        bench += ["--output-len", str(output_len), "--range-ratio", "0", "--out", str(result)]
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        summary: dict[str, Any] = json.loads(result.read_text())["summary"]
        return summary
    finally:
        server.terminate()
        server.wait(30)


def offline(dtype: str, n: int, input_len: int, output_len: int) -> float:
    """Output tokens/s of the engine stepped on this (main) thread, 4 requests in flight."""
    from pdserve.engine.sequence import SamplingParams

    engine = make_engine(dtype)
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 49000) for _ in range(input_len)] for _ in range(n + 1)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.generate([prompts[-1]], [SamplingParams(max_tokens=4, temperature=0.0)])  # warm
    start, added, done, live = time.perf_counter(), 0, 0, 0
    while done < n:
        while live < 4 and added < n:
            engine.add_request(f"r{added}", prompts[added], params)
            added, live = added + 1, live + 1
        for out in engine.step():
            if out.finished:
                done, live = done + 1, live - 1
    return n * output_len / (time.perf_counter() - start)


def in_fresh_process(args: list[str]) -> Any:
    out = subprocess.run(
        [sys.executable, __file__, *args], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="layouts run this many times each")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="benchmarks/results/engine_thread.json")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.child is not None:  # one measurement in this fresh process
        if args.child == "offline":
            tok_s = offline(args.dtype, args.num_prompts, args.input_len, args.output_len)
            print(json.dumps({"output_tok_s": tok_s}))
        else:
            print(json.dumps(run_layout(args.child, args.dtype)))
        return

    layouts: dict[str, list[dict[str, float]]] = {name: [] for name in LAYOUTS}
    for _ in range(args.rounds):  # alternating, so drift in the machine hits every layout
        for name in LAYOUTS:
            layouts[name].append(in_fresh_process(["--child", name, "--dtype", args.dtype]))
            print(name, layouts[name][-1], flush=True)
    shape = [args.dtype, args.num_prompts, args.input_len, args.output_len]
    offline_runs, served_runs = [], []
    for _ in range(args.rounds):
        child = ["--child", "offline", "--dtype", args.dtype, "--num-prompts", str(shape[1])]
        child += ["--input-len", str(shape[2]), "--output-len", str(shape[3])]
        offline_runs.append(in_fresh_process(child)["output_tok_s"])
        served_runs.append(served(*shape))  # type: ignore[arg-type]
        print("offline", offline_runs[-1], "served", served_runs[-1]["output_token_throughput"])

    def median_step(name: str) -> float:
        steps = sorted(r["decode_step_ms_p50"] for r in layouts[name])
        return steps[len(steps) // 2]

    served_tok_s = [s["output_token_throughput"] for s in served_runs]
    result = {
        "machine": {"cpu": os.uname().machine, "cores": os.cpu_count()},
        "model": "SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "decode_layouts": {
            "workload": {"sequences": DECODE_SEQS, "context": CONTEXT, "tokens": DECODE_TOKENS},
            "runs": layouts,
            "step_ms_median_of_runs": {name: median_step(name) for name in LAYOUTS},
            "ratio_two_threads_vs_main": median_step("two-threads") / median_step("main"),
            "ratio_engine_thread_vs_main": median_step("engine-thread") / median_step("main"),
        },
        "served_vs_offline": {
            "workload": {
                "num_prompts": args.num_prompts,
                "concurrency": 4,
                "input_len": args.input_len,
                "output_len": args.output_len,
            },
            "offline_output_tok_s": offline_runs,
            "served_output_tok_s": served_tok_s,
            "served_itl_p50_ms": [s["itl_ms"]["p50"] for s in served_runs],
            "ratio_served_vs_offline": sum(served_tok_s) / sum(offline_runs),
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("decode_layouts", "served_vs_offline")}, indent=2))


if __name__ == "__main__":
    main()
