"""`pdserve serve` without a role: a local prefill+decode pair as two processes on loopback,
each pinned to its own CPU core where the machine has two or more, built from the same configs
the CLI made (handed to each child pickled on its stdin, not turned back into flags).

Lifecycle: build the compiled kernels if they are not yet -> start prefill, then decode
pointing at it -> wait until both answer /health -> print the URL and a curl example -> on
SIGINT/SIGTERM (or if either child dies) send SIGTERM to both, wait, SIGKILL what is left.
No child outlives the launcher.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.client import HTTPException
from pathlib import Path
from types import FrameType

from pdserve.config import EngineConfig, HttpConfig, NodeConfig
from pdserve.serve.logs import configure_logging

READY_TIMEOUT_S = 600
STOP_TIMEOUT_S = 15
SUPERVISE_TICK_S = 0.2  # supervising two children, not waiting on a request


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PICK = 10000  # ports the launcher picks for its nodes are at least this


def _ephemeral_low() -> int | None:
    """The lowest port the kernel hands to a bind to port 0 (Linux), or None if unknown."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port free on `host` for a node to bind a moment later (the launcher's, and the
    benchmarks' for the servers they start). Picked below the kernel's
    ephemeral range where it leaves room: between this pick and the node's bind, any listener
    bound to port 0 (a KV receiver, UCX, another test's server) could otherwise be handed the
    very same port; one in CI was, and the node's health URL answered `PDKV1`. Only a process
    picking explicitly in the same range (another launcher) can still meet it there."""
    low = _ephemeral_low()
    if low is not None and low - LOWEST_PICK >= 1000:
        rng = rng or random.Random()
        for _ in range(100):
            port = rng.randrange(LOWEST_PICK, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def health_status(url: str) -> int | None:
    """The HTTP status a node's own /health `url` answers with, None if it does not answer (or
    answers with something other than HTTP: another process's listener may sit on a port picked
    free a moment before; a KV receiver answering `PDKV1` was seen so in CI). For a supervisor
    of its own nodes (on the host they were told to bind): with TLS, their certificate may be
    self-signed, and this check is not where it is verified."""
    context = ssl._create_unverified_context() if url.startswith("https") else None  # noqa: S323
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, OSError, HTTPException):
        return None


def _healthy(url: str) -> bool:
    return health_status(url) == 200


def _child_main() -> None:
    """A child process (`python -m pdserve.serve.launcher`): one node with its HTTP API, from
    the configs pickled on stdin by the launcher (its parent, the only writer)."""
    import asyncio

    from pdserve.serve.node import serve_node

    role, engine_config, model_dir, config, http, log_level, log_format = pickle.load(
        sys.stdin.buffer
    )
    configure_logging(log_level, log_format)
    asyncio.run(serve_node(role, engine_config, model_dir, config, http))


def _pin(core: int | None) -> Callable[[], None] | None:
    return None if core is None else lambda: os.sched_setaffinity(0, {core})


def _role_engines(
    engine_config: EngineConfig, sizes: dict[str, int]
) -> tuple[dict[str, EngineConfig], bool]:
    """Each role's engine config (its tensor-parallel size), and whether each node is pinned
    to a core of its own (two cores or more, one process per node)."""
    engines = {
        role: dataclasses.replace(
            engine_config,
            tensor_parallel_size=sizes.get(role, engine_config.tensor_parallel_size),
        )
        for role in ("prefill", "decode")
    }
    cores = os.sched_getaffinity(0)
    # One core per node when each is one process; tensor-parallel ranks share the cores.
    pinned = len(cores) >= 2 and all(e.tensor_parallel_size == 1 for e in engines.values())
    if engine_config.num_threads is None and pinned:
        engines = {r: dataclasses.replace(e, num_threads=1) for r, e in engines.items()}
    return engines, pinned


def _spawn(configs: tuple[object, ...], core: int | None) -> subprocess.Popen[bytes]:
    """A node in a child process, its configs handed over on its stdin."""
    cmd = [sys.executable, "-m", "pdserve.serve.launcher"]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, preexec_fn=_pin(core))
    assert child.stdin is not None
    with child.stdin:
        pickle.dump(configs, child.stdin)
    return child


def _supervise(
    children: list[subprocess.Popen[bytes]],
    urls: list[str],
    stopping: Callable[[], bool],
    on_ready: Callable[[], None],
) -> int:
    """Wait (bounded) until every node answers its health URL, then until a signal; 1 as soon
    as a node exits or the nodes do not become healthy in time."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not stopping() and not all(_healthy(u) for u in urls):
        if any(c.poll() is not None for c in children):
            print("pdserve: error: a node exited during start-up", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            print("pdserve: error: the nodes did not become healthy in time", file=sys.stderr)
            return 1
        time.sleep(SUPERVISE_TICK_S)
    if not stopping():
        on_ready()
    while not stopping():
        if any(c.poll() is not None for c in children):
            print("pdserve: error: a node exited; stopping the other", file=sys.stderr)
            return 1
        time.sleep(SUPERVISE_TICK_S)
    return 0


def run_local_cluster(
    engine_config: EngineConfig,
    model_dir: Path,
    config: NodeConfig,
    http: HttpConfig,
    log_level: str,
    log_format: str = "text",
    tensor_parallel: dict[str, int] | None = None,  # per role (default: the engine's size)
) -> int:
    engines, pinned = _role_engines(engine_config, tensor_parallel or {})
    cores = sorted(os.sched_getaffinity(0))
    host = config.grpc_host
    prefill_grpc = free_port(host)
    prefill_http = dataclasses.replace(http, port=free_port(http.host))
    nodes = {
        "prefill": (dataclasses.replace(config, port=prefill_grpc, transfer_port=0), prefill_http),
        "decode": (
            dataclasses.replace(config, prefill_addresses=(f"{host}:{prefill_grpc}",)),
            http,
        ),
    }
    children: list[subprocess.Popen[bytes]] = []
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if engine_config.attention_backend == "auto":
            _build_kernels()
        for i, (role, (node, node_http)) in enumerate(nodes.items()):
            configs = (role, engines[role], model_dir, node, node_http, log_level, log_format)
            children.append(_spawn(configs, cores[i] if pinned else None))
        scheme = "https" if http.tls.serves else "http"
        url = f"{scheme}://{http.host}:{http.port}"
        urls = [f"{scheme}://{http.host}:{prefill_http.port}/health", f"{url}/health"]
        return _supervise(
            children,
            urls,
            lambda: stopping,
            lambda: _announce(url, http.served_model_name, pinned),
        )
    finally:
        _stop_all(children)
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _build_kernels() -> None:
    """Build the compiled kernels once, here, before either node starts: two nodes building them
    inside their start-up would each do it on one core, behind the readiness wait. Says when it
    builds (fused.py logs it); a failure is the nodes' to report (they run the torch paths)."""
    subprocess.run([sys.executable, "-m", "pdserve.model.fused"], stdout=subprocess.DEVNULL)


def _announce(url: str, model: str, pinned: bool) -> None:
    where = "cores 0 and 1" if pinned else "shared cores"
    print(f"pdserve serving {model} at {url} (prefill + decode on {where})", flush=True)
    print(
        f"try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{model}", "messages": [{{"role": "user", "content": '
        f'"Write a haiku about the sea."}}], "max_tokens": 64}}\'',
        flush=True,
    )


def _stop_all(children: list[subprocess.Popen[bytes]]) -> None:
    for c in children:
        if c.poll() is None:
            c.terminate()  # SIGTERM: the node fails requests in flight and exits
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for c in children:
        try:
            c.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()


if __name__ == "__main__":
    _child_main()
