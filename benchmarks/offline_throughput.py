"""Offline throughput: pdserve's engine vs Hugging Face transformers `generate`, side by side in
one run, same model, dtype and threads.

Workload (fixed seed): N requests with prompts of 128-1024 tokens and 64-128 output tokens
(ignore_eos, so every run produces exactly the same number of tokens). transformers runs the
workload at batch 1 (a subset, it is slow) and in left-padded batches; pdserve runs it all at
once with continuous batching. Also measured: batch-1 decode and 512-token prefill speed.

    .venv/bin/python benchmarks/offline_throughput.py [--num-requests 64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, default_cache_dir
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from pdserve.model.fetch import resolve_model

# Figures stated in the issue for this machine kind (2 threads, SmolLM2-135M, bf16).
VLLM_CPU = {"prefill_512_tok_s": 3400, "decode_b1_tok_s": 40, "decode_b8_total_tok_s": 214}


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    # Ordinary vocabulary ids (skip the special tokens at the start of SmolLM2's vocabulary).
    return [
        ([rng.randrange(100, 49000) for _ in range(rng.randint(128, 1024))], rng.randint(64, 128))
        for _ in range(n)
    ]


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_pdserve(engine: LLMEngine, reqs: list[tuple[list[int], int]]) -> float:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in reqs]
    return timed(lambda: engine.generate([p for p, _ in reqs], params))


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


def run_hf(model: Any, reqs: list[tuple[list[int], int]], batch: int) -> tuple[float, int]:
    """Seconds and useful output tokens; a padded batch decodes until its longest output."""
    elapsed, tokens = 0.0, 0
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        longest = max(m for _, m in chunk)
        elapsed += timed(lambda c=chunk, m=longest: hf_generate(model, [p for p, _ in c], m))
        tokens += sum(m for _, m in chunk)
    return elapsed, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--hf-batch1-requests", type=int, default=8, help="subset run at batch 1")
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/offline_throughput.json")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    model_dir = resolve_model("default", default_cache_dir(), args.dtype)
    reqs = workload(args.num_requests, args.seed)
    total_out = sum(m for _, m in reqs)

    engine = LLMEngine(
        EngineConfig(
            dtype=args.dtype,
            num_threads=args.threads,
            cache=CacheConfig(kv_cache_memory=2048 * 1024**2),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
        ),
        model_dir,
    )
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, args.dtype)
    ).eval()

    # Warm both up once.
    run_pdserve(engine, reqs[:2])
    hf_generate(hf, [reqs[0][0][:64]], 4)

    short = [list(range(1000, 1128))]
    b1 = {
        "pdserve": 128 / run_pdserve(engine, [(short[0], 128)]),
        "transformers": 128 / timed(lambda: hf_generate(hf, short, 128)),
    }
    batch8 = [[1000 + 50 * i + j for j in range(128)] for i in range(8)]
    b8 = {
        "pdserve": 8 * 128 / run_pdserve(engine, [(p, 128) for p in batch8]),
        "transformers_padded": 8 * 128 / timed(lambda: hf_generate(hf, batch8, 128)),
    }
    p512 = reqs[0][0][:512] if len(reqs[0][0]) >= 512 else [7] * 512
    prefill = {
        "pdserve": 512 / run_pdserve(engine, [([t + 1 for t in p512], 1)]),
        "transformers": 512 / timed(lambda: hf_generate(hf, [p512], 1)),
    }
    ours_s = run_pdserve(engine, reqs)
    hf1_s, hf1_tok = run_hf(hf, reqs[: args.hf_batch1_requests], 1)
    hfb_s, hfb_tok = run_hf(hf, reqs, args.hf_batch)
    ours = total_out / ours_s
    hf1 = hf1_tok / hf1_s
    hfb = hfb_tok / hfb_s
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized)",
        "dtype": args.dtype,
        "workload": {
            "num_requests": args.num_requests,
            "prompt_tokens": [128, 1024],
            "output_tokens": [64, 128],
            "seed": args.seed,
            "total_output_tokens": total_out,
        },
        "output_tokens_per_s": {
            "pdserve": ours,
            "transformers_batch1": hf1,
            f"transformers_padded_batch{args.hf_batch}": hfb,
        },
        "ratio_pdserve_vs_transformers_batch1": ours / hf1,
        f"ratio_pdserve_vs_transformers_padded_batch{args.hf_batch}": ours / hfb,
        "decode_batch1_tokens_per_s": b1,
        "ratio_decode_batch1": b1["pdserve"] / b1["transformers"],
        "decode_batch8_total_tokens_per_s": b8,
        "prefill_512_tokens_per_s": prefill,
        "vllm_cpu_reference_from_issue": VLLM_CPU,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
