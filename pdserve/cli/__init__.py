"""The `pdserve` command: flags (defined in `flags.py`) become configs, and each command is
dispatched to `serve/` (serve, prefill, decode, generate), `router/`, `cluster/`, `bench/`,
or to a running router (drain)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve.cli.configs import (
    cluster_config,
    engine_config,
    http_config,
    node_config,
    router_config,
)
from pdserve.cli.flags import build_parser
from pdserve.config import ConfigError, ModelConfig, default_cache_dir
from pdserve.model.fetch import ModelFetchError, resolve_model
from pdserve.model.heap import keep_freed_memory
from pdserve.serve.logs import configure_logging


def cmd_node(args: argparse.Namespace) -> int:
    """`serve` (a local cluster, or one node with HTTP), `prefill` or `decode` (gRPC only)."""
    import asyncio

    from pdserve.model.parallel import check_shardable
    from pdserve.serve.launcher import run_local_cluster
    from pdserve.serve.node import serve_node

    role = getattr(args, "role", None) if args.command == "serve" else args.command
    if role == "decode" and not args.prefill:
        raise ConfigError("--role decode needs at least one --prefill HOST:PORT")
    engine, node = engine_config(args), node_config(args)
    model_dir = resolve_model(
        engine.model, Path(str(engine.cache_dir)), engine.dtype, engine.revision
    )
    http = None
    if args.command == "serve":
        http = http_config(args)
        if role is None:
            sizes = {
                "prefill": args.prefill_tp or engine.tensor_parallel_size,
                "decode": args.decode_tp or engine.tensor_parallel_size,
            }
            model = ModelConfig.from_dir(model_dir)
            for size in sizes.values():  # refused here, naming the heads, before any start
                check_shardable(model, size)
            return run_local_cluster(
                engine, model_dir, node, http, args.log_level, args.log_format, sizes
            )
        if args.prefill_tp or args.decode_tp:
            raise ConfigError("--prefill-tp and --decode-tp are for `serve` without --role")
    assert role is not None
    asyncio.run(serve_node(role, engine, model_dir, node, http))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.engine.sequence import SamplingParams
    from pdserve.serve.offline import generate_offline

    config = engine_config(args)
    model_dir = resolve_model(
        config.model, Path(str(config.cache_dir)), config.dtype, config.revision
    )
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    return generate_offline(config, model_dir, args.prompt, params, args.chat)


def cmd_router(args: argparse.Namespace) -> int:
    import asyncio

    from pdserve.router.run import serve_router

    config = router_config(args)
    if config.tokenizer is not None:  # a model name as the nodes take it: resolve it the same
        model_dir = resolve_model(config.tokenizer, default_cache_dir(), "float32")
        config = dataclasses.replace(config, tokenizer=str(model_dir))
    asyncio.run(serve_router(config, args.host, args.port))
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    import asyncio

    from pdserve.cluster.run import serve_cluster

    asyncio.run(serve_cluster(cluster_config(args), router_config(args), args.host, args.port))
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    """`pdserve drain`: asks the router to take a decode out of rotation (or put it back);
    prints what it did; 0 once the decode holds no request the router sent it."""
    import json

    import httpx

    from pdserve.cli.configs import api_key

    key = api_key(args)
    headers = {"authorization": "Bearer " + key.value.decode()} if key is not None else {}
    body = {
        "decode": args.decode,
        "timeout_s": args.timeout,
        "undo": args.undo,
        "migrate": not args.recompute,
    }
    try:
        r = httpx.post(
            args.router.rstrip("/") + "/admin/drain",
            json=body,
            headers=headers,
            timeout=args.timeout + 30,
        )
    except httpx.HTTPError as e:
        raise ConfigError(f"cannot reach the router at {args.router}: {e}") from e
    if r.status_code != 200:
        raise ConfigError(f"the router refused ({r.status_code}): {r.text[:500]}")
    answer = r.json()
    print(json.dumps(answer))
    return 0 if args.undo or answer["drained"] else 1


def cmd_top(args: argparse.Namespace) -> int:
    """`pdserve top`: the fleet behind a router, refreshed in the terminal."""
    from pdserve.cli.configs import api_key
    from pdserve.router.top import run_top

    key = api_key(args)
    return run_top(args.router, key.value.decode() if key else None, args.interval, args.once)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(cmd_generate, cmd_node, cmd_router, cmd_cluster, cmd_drain, cmd_top)
    args = parser.parse_args(argv)
    keep_freed_memory()  # a pdserve process: each step's temporaries reused, not faulted in again
    try:
        configure_logging(args.log_level, args.log_format)
        return int(args.func(args))
    except (ModelFetchError, ConfigError, ValueError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
