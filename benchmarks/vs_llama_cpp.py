"""Batch-1 decode: pdserve with int4 weights (and bf16) vs llama.cpp on the same Q4_1 GGUF, side
by side in one run on this machine.

llama.cpp runs through node-llama-cpp's prebuilt CPU binaries (llama.cpp picks its kernels for
this CPU at load), because llama.cpp ships no wheel on PyPI and no Debian 12 package. Install it
outside the project (~40 MB, no build):

    mkdir -p /tmp/nlc && cd /tmp/nlc && NODE_LLAMA_CPP_SKIP_DOWNLOAD=true \\
        npm install node-llama-cpp@3.22.1 @node-llama-cpp/linux-x64@3.22.1

Each system runs in a process of its own with the same thread count, on the same prompt text,
greedy, `--tokens` tokens after the first; the systems alternate for `--rounds` rounds. Decode
tok/s counts the tokens after the first over the time after the first (the prompt's prefill is
reported apart, as TTFT).

    .venv/bin/python benchmarks/vs_llama_cpp.py [--node-llama-cpp /tmp/nlc] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"

JS = """
import {getLlama} from "node-llama-cpp";
const [modelPath, prompt, nTokens, threads] = process.argv.slice(2);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({
    contextSize: 1024, sequences: 1, threads: {ideal: +threads, min: +threads}});
const sequence = context.getSequence();
const tokens = model.tokenize(prompt);
const start = performance.now();
let first = null;
const out = [];
for await (const token of sequence.evaluate(tokens, {temperature: 0})) {
    if (first === null) first = performance.now();
    out.push(token);
    if (out.length > +nTokens) break;
}
const end = performance.now();
console.log(JSON.stringify({prompt_tokens: tokens.length, ttft_ms: first - start,
    decode_tok_s: +nTokens / ((end - first) / 1000), generated: out.length}));
await context.dispose();
await model.dispose();
await llama.dispose();
"""


def run_llama_cpp(nlc: Path, gguf: Path, tokens: int, threads: int) -> dict[str, Any]:
    script = nlc / "pdserve_decode_bench.mjs"  # beside node_modules, so the import resolves
    script.write_text(JS)
    out = subprocess.run(
        ["node", str(script), str(gguf), PROMPT, str(tokens), str(threads)],
        capture_output=True, text=True, timeout=600, cwd=nlc, check=True,
    )  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def pdserve_child(quantization: str, tokens: int, threads: int) -> dict[str, Any]:
    """Runs in a process of its own (see main): one greedy request, timed per step."""
    from pdserve.config import CacheConfig, EngineConfig, default_cache_dir
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sequence import SamplingParams
    from pdserve.model.fetch import resolve_model

    model_dir = resolve_model("default", default_cache_dir(), "bfloat16")
    config = EngineConfig(
        dtype="bfloat16", num_threads=threads, quantization=quantization,
        cache=CacheConfig(num_blocks=256),
    )  # fmt: skip
    engine = LLMEngine(config, model_dir)
    ids = engine.tokenizer.encode(PROMPT)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate([ids], warm)
    engine.add_request("bench", ids, SamplingParams(max_tokens=tokens + 1, temperature=0.0,
                                                    ignore_eos=True))  # fmt: skip
    start = time.perf_counter()
    first: float | None = None
    done = False
    while not done:
        for o in engine.step():
            if first is None and o.token_ids:
                first = time.perf_counter()
            done = done or o.finished
    end = time.perf_counter()
    assert first is not None
    return {
        "prompt_tokens": len(ids),
        "ttft_ms": (first - start) * 1e3,
        "decode_tok_s": tokens / (end - first),
    }


def run_pdserve(quantization: str, tokens: int, threads: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", quantization, "--tokens", str(tokens),
         "--threads", str(threads)],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--node-llama-cpp", type=Path, default=Path("/tmp/nlc"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "vs_llama_cpp.json")
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(pdserve_child(args.child, args.tokens, args.threads)))
        return 0
    nlc = args.node_llama_cpp
    if shutil.which("node") is None or not (nlc / "node_modules" / "node-llama-cpp").is_dir():
        print(f"node-llama-cpp is not installed in {nlc}; see this script's docstring.",
              file=sys.stderr)  # fmt: skip
        return 2
    from pdserve.config import default_cache_dir
    from pdserve.model.fetch import fetch_default_gguf

    gguf = fetch_default_gguf(default_cache_dir())
    systems = {
        "llama.cpp Q4_1": lambda: run_llama_cpp(nlc, gguf, args.tokens, args.threads),
        "pdserve int4": lambda: run_pdserve("int4", args.tokens, args.threads),
        "pdserve bf16": lambda: run_pdserve("none", args.tokens, args.threads),
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    for r in range(args.rounds):
        for name, run in systems.items():
            runs[name].append(run())
            print(f"[round {r + 1}] {name}: {runs[name][-1]}", flush=True)
    median = {
        name: {k: statistics.median(x[k] for x in rs) for k in ("ttft_ms", "decode_tok_s")}
        for name, rs in runs.items()
    }
    base = median["llama.cpp Q4_1"]["decode_tok_s"]
    result = {
        "machine": {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine()},
        "gguf": gguf.name,
        "prompt": PROMPT,
        "tokens": args.tokens,
        "threads": args.threads,
        "runs": runs,
        "median": median,
        "decode_vs_llama_cpp": {n: m["decode_tok_s"] / base for n, m in median.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({"median": median, "decode_vs_llama_cpp": result["decode_vs_llama_cpp"]},
                     indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
