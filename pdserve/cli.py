"""Command line: `pdserve serve | generate | prefill | decode`. Flags become frozen configs
here, the only place that reads the environment."""

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
from pdserve.disagg.node_common import NodeConfig
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


def add_node_args(p: argparse.ArgumentParser, role: str) -> None:
    """Flags of a node; `role` is prefill, decode or serve (which takes every flag)."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    grpc_flag = "--grpc-port" if role == "serve" else "--port"
    p.add_argument(grpc_flag, dest="grpc_port", type=int, default=0, help="gRPC port (0: free)")
    p.add_argument("--transfer-port", type=int, default=0, help="KV transfer port (0: a free one)")
    p.add_argument("--transfer-backend", default="tcp", choices=["tcp", "inprocess"])
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds per request")
    if role in ("decode", "serve"):
        p.add_argument(
            "--advertise-host",
            default=None,
            help="decode: the address prefill nodes reach this node's KV receiver at "
            "(default: --host; set it when binding 0.0.0.0)",
        )
        p.add_argument(
            "--prefill",
            action="append",
            required=role == "decode",
            metavar="HOST:PORT",
            help="a prefill node's gRPC address (repeatable)",
        )
        p.add_argument(
            "--min-prefill-tokens",
            type=int,
            default=8,
            help="prompts shorter than this are prefilled on decode itself",
        )
        p.add_argument(
            "--probe-cap", type=float, default=2.0, help="cap in seconds on probing a prefill node"
        )
    if role in ("prefill", "serve"):
        p.add_argument(  # fault injection for tests: a slow network
            "--testing-transfer-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS
        )
    if role == "serve":
        p.add_argument(
            "--role",
            choices=["prefill", "decode", "both"],
            default=None,
            help="run one node (default: a local prefill+decode pair)",
        )
        p.add_argument("--port", dest="http_port", type=int, default=8000, help="HTTP port")
        p.add_argument(
            "--served-model-name",
            default=None,
            help="model name clients send (default: derived from --model)",
        )
        p.add_argument(
            "--max-pending",
            type=int,
            default=256,
            help="requests in the engine beyond which new ones get HTTP 503",
        )


def node_config(args: argparse.Namespace) -> NodeConfig:
    return NodeConfig(
        host=args.host,
        port=args.grpc_port,
        transfer_port=args.transfer_port,
        transfer_backend=args.transfer_backend,
        advertise_host=getattr(args, "advertise_host", None),
        prefill_addresses=tuple(getattr(args, "prefill", None) or ()),
        min_prompt_tokens=getattr(args, "min_prefill_tokens", 8),
        request_timeout_s=args.request_timeout,
        probe_cap_s=getattr(args, "probe_cap", 2.0),
        testing_transfer_delay_s=getattr(args, "testing_transfer_delay_ms", 0.0) / 1000,
    )


def served_model_name(args: argparse.Namespace) -> str:
    if getattr(args, "served_model_name", None):
        return str(args.served_model_name)
    if args.model == "default":
        return "SmolLM2-135M-Instruct"
    from pathlib import Path

    path = Path(args.model)
    return path.stem if path.suffix == ".gguf" else path.name


def cmd_node(args: argparse.Namespace) -> int:
    """One node in this process: prefill, decode or both (colocated); with HTTP under `serve`."""
    import asyncio
    import signal
    from pathlib import Path

    role = args.role if args.command == "serve" else args.command
    http = args.command == "serve"
    if role == "decode" and not args.prefill:
        raise ConfigError("--role decode needs at least one --prefill HOST:PORT")
    config = engine_config(args)
    model_dir = resolve_model(
        config.model, Path(config.cache_dir or default_cache_dir()), config.dtype
    )

    async def serve() -> None:
        from pdserve.api.frontend import (
            ColocatedNode,
            HttpServer,
            decode_backend,
            prefill_backend,
        )
        from pdserve.api.server import ServingBackend
        from pdserve.disagg.decode_server import DecodeNode
        from pdserve.disagg.prefill_server import PrefillNode

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        name = served_model_name(args)
        node: PrefillNode | DecodeNode | ColocatedNode
        server: HttpServer | None = None
        parts = []
        try:
            backend: ServingBackend
            if role == "both":
                node = ColocatedNode(config, model_dir)
                await node.start()
                backend = node.backend(name, args.max_pending)
            elif role == "decode":
                node = DecodeNode(config, model_dir, node_config(args))
                await node.start()
                assert node.grpc is not None
                parts += [f"grpc={node.grpc.address}", f"transfer={node.transfer_address}"]
                backend = decode_backend(node, name, getattr(args, "max_pending", 256))
            else:
                node = PrefillNode(config, model_dir, node_config(args))
                await node.start()
                assert node.grpc is not None
                parts.append(f"grpc={node.grpc.address}")
                backend = prefill_backend(node, name)
            if http:
                server = HttpServer(backend, args.host, args.http_port)
                await server.start()
                parts.insert(0, f"http=http://{server.address}")
            print(f"pdserve {role} ready {' '.join(parts)}", flush=True)
            await stop.wait()
        finally:
            if "node" in locals():
                await node.stop()  # the engine first: requests in flight end with an error
            if server is not None:
                await server.stop()

    asyncio.run(serve())
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.role is not None:
        return cmd_node(args)
    from pdserve.launcher import run_local_cluster

    return run_local_cluster(args)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import math
    from pathlib import Path

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
    )
    records, duration = asyncio.run(run_load(cfg, prompts, progress=not args.no_progress))
    slo_ttft = args.slo_ttft_ms / 1e3 if args.slo_ttft_ms else None
    slo_tpot = args.slo_tpot_ms / 1e3 if args.slo_tpot_ms else None
    summary = summarize(records, duration, slo_ttft, slo_tpot)
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
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


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="model name to send")
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
    serve = sub.add_parser(
        "serve", help="serve the OpenAI API: a local prefill+decode pair, or one --role"
    )
    add_engine_args(serve)
    add_node_args(serve, "serve")
    serve.set_defaults(func=cmd_serve)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser(
        "serve", help="load-test an OpenAI-compatible server (ours or another)"
    )
    add_bench_args(bench_serve)
    bench_serve.set_defaults(func=cmd_bench_serve)
    for role, text in (
        ("prefill", "run a prefill node (gRPC only)"),
        ("decode", "run a decode node (gRPC only)"),
    ):
        node = sub.add_parser(role, help=text)
        add_engine_args(node)
        add_node_args(node, role)
        node.set_defaults(func=cmd_node)
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
