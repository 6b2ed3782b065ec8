"""`pdserve serve` without a role: a local prefill+decode pair as two processes on loopback,
each pinned to its own CPU core where the machine has two or more.

Lifecycle: start prefill, then decode pointing at it -> wait until decode's /health says a
prefill is reachable -> print the URL and a curl example -> on SIGINT/SIGTERM (or if either
child dies) send SIGTERM to both, wait, SIGKILL what is left. No child outlives the launcher.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from types import FrameType

READY_TIMEOUT_S = 600
STOP_TIMEOUT_S = 15


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _engine_flags(args: argparse.Namespace, threads: int | None) -> list[str]:
    flags = [
        "--model", args.model, "--dtype", args.dtype,
        "--kv-cache-memory", str(args.kv_cache_memory), "--block-size", str(args.block_size),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--request-timeout", str(args.request_timeout),
        "--transfer-backend", args.transfer_backend,
        "--host", args.host,
    ]  # fmt: skip
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    if args.no_prefix_caching:
        flags.append("--no-prefix-caching")
    if threads:
        flags += ["--threads", str(threads)]
    if args.served_model_name:
        flags += ["--served-model-name", args.served_model_name]
    return flags


def _pin(core: int | None) -> Callable[[], None] | None:
    if core is None:
        return None
    return lambda: os.sched_setaffinity(0, {core})


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def run_local_cluster(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pdserve.config import default_cache_dir
    from pdserve.model.fetch import resolve_model

    # Fetch and convert once here, not in both children at the same time.
    resolve_model(args.model, Path(default_cache_dir()), args.dtype)
    cores = sorted(os.sched_getaffinity(0))
    pinned = len(cores) >= 2
    threads = args.threads or (1 if pinned else None)
    host = args.host
    prefill_grpc = _free_port(host)
    base = [sys.executable, "-m", "pdserve.cli", "--log-level", args.log_level, "serve"]
    common = _engine_flags(args, threads)
    prefill_http = _free_port(host)
    prefill_cmd = [*base, "--role", "prefill", "--grpc-port", str(prefill_grpc),
                   "--port", str(prefill_http), *common]  # fmt: skip
    if args.testing_transfer_delay_ms:
        prefill_cmd += ["--testing-transfer-delay-ms", str(args.testing_transfer_delay_ms)]
    decode_cmd = [*base, "--role", "decode", "--port", str(args.http_port),
                  "--grpc-port", str(args.grpc_port), "--transfer-port", str(args.transfer_port),
                  "--prefill", f"{host}:{prefill_grpc}",
                  "--min-prefill-tokens", str(args.min_prefill_tokens),
                  "--probe-cap", str(args.probe_cap), *common]  # fmt: skip
    children: list[subprocess.Popen[bytes]] = []
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        children.append(
            subprocess.Popen(prefill_cmd, preexec_fn=_pin(cores[0] if pinned else None))
        )
        children.append(subprocess.Popen(decode_cmd, preexec_fn=_pin(cores[1] if pinned else None)))
        url = f"http://{host}:{args.http_port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        prefill_url = f"http://{host}:{prefill_http}"
        while not stopping and not (
            _healthy(f"{prefill_url}/health") and _healthy(f"{url}/health")
        ):
            if any(c.poll() is not None for c in children):
                print("pdserve: error: a node exited during start-up", file=sys.stderr)
                return 1
            if time.monotonic() > deadline:
                print("pdserve: error: the nodes did not become healthy in time", file=sys.stderr)
                return 1
            time.sleep(0.2)
        if not stopping:
            model = args.served_model_name or _default_name(args)
            where = "cores 0 and 1" if pinned else "shared cores"
            print(f"pdserve serving {model} at {url} (prefill + decode on {where})", flush=True)
            print(
                f"try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
                f'-d \'{{"model": "{model}", "messages": [{{"role": "user", "content": '
                f'"Write a haiku about the sea."}}], "max_tokens": 64}}\'',
                flush=True,
            )
        while not stopping:
            if any(c.poll() is not None for c in children):
                print("pdserve: error: a node exited; stopping the other", file=sys.stderr)
                return 1
            time.sleep(0.2)  # supervising two children, not waiting on a request
        return 0
    finally:
        _stop_all(children)
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _default_name(args: argparse.Namespace) -> str:
    from pdserve.cli import served_model_name

    return served_model_name(args)


def _stop_all(children: list[subprocess.Popen[bytes]]) -> None:
    for c in children:
        if c.poll() is None:
            c.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for c in children:
        try:
            c.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
