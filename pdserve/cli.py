"""Command line: `pdserve generate` (more subcommands join as the nodes land). Flags become
frozen configs here, the only place that reads the environment."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

from pdserve.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    default_cache_dir,
)
from pdserve.model.fetch import ModelFetchError, resolve_model

MIB = 1024**2


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="default",
        help="'default' (SmolLM2-135M-Instruct), a model directory or a .gguf file",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--kv-cache-memory", type=int, default=512, metavar="MIB", help="KV cache budget in MiB"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        cache_dir=str(default_cache_dir()),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory * MIB,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
        ),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sequence import SamplingParams

    config = engine_config(args)
    model_dir = resolve_model(
        config.model, Path(config.cache_dir or default_cache_dir()), config.dtype
    )
    engine = LLMEngine(config, model_dir)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
        for p in args.prompt
    ]
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    for prompt, o in zip(args.prompt, outputs, strict=True):
        print(f"--- {prompt}\n{o.text}")
    print(f"[{tokens} tokens in {elapsed:.2f}s: {tokens / elapsed:.1f} tokens/s]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts on this machine")
    add_engine_args(gen)
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--no-chat",
        dest="chat",
        action="store_false",
        help="send the raw prompt without the chat template",
    )
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args))
    except (ModelFetchError, ConfigError, ValueError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
