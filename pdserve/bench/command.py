"""`pdserve bench serve`: its flags, and the run that loads a server and writes the summary
(and, with --out, every request's record) as JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path

from pdserve.config import DEFAULT_HOST, DEFAULT_HTTP_PORT, DEFAULT_MODEL_NAME


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=f"http://{DEFAULT_HOST}:{DEFAULT_HTTP_PORT}")
    p.add_argument("--model", default=DEFAULT_MODEL_NAME, help="model name to send")
    p.add_argument("--api-key", default=None,
                   help="Bearer token for the server (default: $PDSERVE_API_KEY; never "
                   "written to the results)")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument(
        "--request-rate",
        type=float,
        default=0.0,
        help="requests/s with Poisson arrivals (0: all at once)",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly within +/- this fraction",
    )
    p.add_argument("--dataset", default=None, help='JSONL of {"prompt": ..., "output_len": ...}')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers that refuse it)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default=None, help="write the full results as JSON here")


def run_bench_serve(args: argparse.Namespace) -> int:
    # Here, not at the top: every `pdserve` command builds the parser with `add_bench_args`,
    # and only this one needs the load generator (httpx).
    from pdserve.bench.client import LoadConfig, run_load
    from pdserve.bench.dataset import jsonl_prompts, random_prompts
    from pdserve.bench.stats import record_dict, summarize

    if args.dataset:
        prompts = jsonl_prompts(args.dataset, args.num_prompts, args.seed)
    else:
        prompts = random_prompts(
            args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed
        )
    cfg = LoadConfig(
        base_url=args.base_url.rstrip("/"),
        model=args.model,
        request_rate=args.request_rate if args.request_rate > 0 else math.inf,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        ignore_eos=not args.no_ignore_eos,
        api_key=args.api_key or os.environ.get("PDSERVE_API_KEY"),
    )
    records, duration = asyncio.run(run_load(cfg, prompts, progress=not args.no_progress))
    slo_ttft = args.slo_ttft_ms / 1e3 if args.slo_ttft_ms else None
    slo_tpot = args.slo_tpot_ms / 1e3 if args.slo_tpot_ms else None
    summary = summarize(records, duration, slo_ttft, slo_tpot)
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")},
        "summary": summary,
        "requests": [record_dict(r) for r in records],
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(summary, indent=2))
    errors = [r.error for r in records if not r.ok]
    if errors:
        print(f"{len(errors)} requests failed; first: {errors[0]}", file=sys.stderr)
    return 0 if not errors else 1
