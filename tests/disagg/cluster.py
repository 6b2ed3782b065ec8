"""Real prefill/decode processes on 127.0.0.1 with free ports, always stopped by the test."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import grpc
import torch

from pdserve.config import CacheConfig, EngineConfig, NodeConfig, Secret
from pdserve.disagg.auth import SyncClientAuth
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.serve.decode_node import DecodeNode

READY_TIMEOUT_S = 180


_CLAIMED: list[IO[str]] = []  # lock files held for this process's life: a port is picked once
_PICK = random.Random()  # not the tests' seeded global generator


def free_port() -> int:
    """A port for a node of a test to listen on on 127.0.0.1. Free when picked, outside the
    kernel's ephemeral range, so that nothing on the machine (an outgoing connection, a bind to
    port 0, a library's listener) is given it before the node binds it, which a port the kernel
    picked could be; and claimed with a lock file this process holds, so that no other test
    process (the other pytest-xdist worker) picks it too."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = list(range(20000, low)) if low > 21000 else list(range(high + 1, 65536))
    locks = Path(tempfile.gettempdir()) / "pdserve-test-ports"
    locks.mkdir(exist_ok=True)
    for port in _PICK.sample(ports, len(ports)):
        claim = open(locks / str(port), "a")  # noqa: SIM115 (held until the process ends)
        try:
            fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
        except OSError:  # claimed by another process, or in use
            claim.close()
            continue
        _CLAIMED.append(claim)
        return port
    raise RuntimeError(f"no free port outside the ephemeral range {low}-{high}")


@contextlib.contextmanager
def inprocess_decode(tmp_path: Path, max_concurrent_rpcs: int = 64) -> Iterator[DecodeNode]:
    """A decode node serving in this process on a tiny random model, its event loop on a thread
    of its own (its prefill is never reached: prompts run here)."""
    from tests.helpers import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tiny")
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, name="node-loop", daemon=True)
    loop_thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)  # noqa: E731
    config = EngineConfig(dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=32))
    node_config = NodeConfig(
        prefill_addresses=(f"127.0.0.1:{free_port()}",),
        min_prompt_tokens=10_000,
        max_concurrent_rpcs=max_concurrent_rpcs,
    )
    node = DecodeNode(config, model_dir, node_config)
    torch_threads = torch.get_num_threads()
    try:
        run(node.start())
        yield node
    finally:
        run(node.stop())
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(5)
        torch.set_num_threads(torch_threads)


class NodeProcess:
    def __init__(
        self,
        role: str,
        args: list[str],
        dtype: str = "float32",
        port: int | None = None,
        model: Path | None = None,
    ) -> None:
        self.role = role
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix=f"pdserve-{role}-", suffix=".log")[1])
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "--log-level",
            "INFO",
            role,
            "--dtype",
            dtype,
            "--port",
            str(self.port),
            "--threads",
            "1",
            *(["--model", str(model)] if model is not None else []),
            # A test's tiny model gets a small cache (thousands of blocks, not the default
            # 512 MiB's hundred thousand): a quicker start, the same behaviour.
            *(["--kv-cache-memory", "32"] if model is not None else []),
            # A request that hangs fails in a minute, naming its stage, well within the test's
            # own timeout (the default deadline is 10 minutes).
            "--request-timeout",
            "60",
            *args,
        ]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                # UCX (the nixl backend) would pick network interfaces itself: loopback only.
                env={**os.environ, "PYTHONUNBUFFERED": "1", "UCX_NET_DEVICES": "lo"},
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if "ready grpc=" in self.log.read_text():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.role} not ready:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        self.terminate()
        self.wait_stopped()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def wait_stopped(self) -> None:
        """After `terminate`: its exit, or SIGKILL after 15 s."""
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()


@contextlib.contextmanager
def nodes(*procs: NodeProcess) -> Iterator[None]:
    """The nodes ready for the block, stopped after it; their logs are removed when it
    succeeds and kept (in the temp directory) when it fails."""
    passed = False
    try:
        for p in procs:
            p.wait_ready()
        yield
        passed = True
    finally:
        for p in procs:  # all at once: their shutdowns overlap
            p.terminate()
        for p in procs:
            p.wait_stopped()
            if passed:
                p.log.unlink(missing_ok=True)


def start_pair(
    prefill_args: list[str] | None = None,
    decode_args: list[str] | None = None,
    dtype: str = "float32",
    backend: str = "tcp",
    model: Path | None = None,
) -> tuple[NodeProcess, NodeProcess]:
    """A prefill and a decode pointed at it, both on the transfer `backend` (and `model`;
    default: the bundled SmolLM2), every frame checksummed and verified."""
    both = ["--transfer-backend", backend, "--kv-checksum"]
    prefill = NodeProcess("prefill", [*both, *(prefill_args or [])], dtype, model=model)
    decode = NodeProcess(
        "decode", [*both, "--prefill", prefill.address, *(decode_args or [])], dtype, model=model
    )
    return prefill, decode


def channel(address: str, secret: Secret | None = None, ca: bytes | None = None) -> grpc.Channel:
    """A blocking channel to a node: with its cluster secret and TLS root if it uses them."""
    if ca is not None:
        ch = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca))
    else:
        ch = grpc.insecure_channel(address)
    return grpc.intercept_channel(ch, SyncClientAuth(secret)) if secret is not None else ch


def decode_stub(
    address: str, secret: Secret | None = None, ca: bytes | None = None
) -> pb_grpc.DecodeServiceStub:
    return pb_grpc.DecodeServiceStub(channel(address, secret, ca))


def prefill_stub(
    address: str, secret: Secret | None = None, ca: bytes | None = None
) -> pb_grpc.PrefillServiceStub:
    return pb_grpc.PrefillServiceStub(channel(address, secret, ca))


def generate(
    stub: pb_grpc.DecodeServiceStub,
    token_ids: list[int],
    max_tokens: int,
    timeout_s: float = 0.0,
    ignore_eos: bool = True,
) -> tuple[list[int], bool]:
    """(output tokens, whether decode prefilled remotely)."""
    tokens: list[int] = []
    remote = False
    request = pb.GenerateRequest(
        token_ids=token_ids,
        sampling=pb.SamplingConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos),
        timeout_s=timeout_s,
    )
    for r in stub.Generate(request):
        tokens.extend(r.token_ids)
        remote = remote or r.remote_prefill
    return tokens, remote


def call_in_thread(stub, prompt: list[int], timeout_s: float = 0.0):  # type: ignore[no-untyped-def]
    """Start a Generate of 8 tokens; (thread, box): box gets the tokens or the error, and
    when the call ended ("at", monotonic)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["tokens"] = generate(stub, prompt, 8, timeout_s=timeout_s)[0]
        except grpc.RpcError as e:
            box["error"] = e
        box["at"] = time.monotonic()

    t = threading.Thread(target=run)
    t.start()
    return t, box


def assert_clean(
    decode: pb_grpc.DecodeServiceStub,
    prefill: pb_grpc.PrefillServiceStub | None,
    within_s: float = 2.0,
) -> None:
    """Every block free on both nodes, store and side channel empty, no per-request task."""
    deadline = time.monotonic() + within_s
    while True:
        d = decode.GetStats(pb.StatsRequest(), timeout=5)
        p = prefill.GetStats(pb.StatsRequest(), timeout=5) if prefill is not None else None
        problems = []
        if d.num_free_blocks != d.num_blocks or d.num_requests:
            problems.append(
                f"decode holds {d.num_blocks - d.num_free_blocks} blocks, {d.num_requests} requests"
            )
        if d.resource_store_entries or d.side_channel_entries or d.pending_tasks:
            problems.append(
                f"decode store {d.resource_store_entries}/{d.side_channel_entries}, "
                f"tasks {d.pending_tasks}"
            )
        if p is not None and (
            p.num_free_blocks != p.num_blocks
            or p.num_requests
            or p.pending_tasks
            or p.held_for_send
        ):
            problems.append(
                f"prefill holds {p.num_blocks - p.num_free_blocks} blocks, "
                f"{p.num_requests} requests, {p.pending_tasks} sends"
            )
        if not problems:
            return
        if time.monotonic() > deadline:
            raise AssertionError("; ".join(problems))
        time.sleep(0.05)


def worker_pids(pid: int) -> list[int]:
    """The tensor-parallel workers a node process spawned (not its resource tracker)."""
    children = [
        int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in cmdline_children(task)
    ]
    return [c for c in children if b"spawn_main" in cmdline(c)]


def cmdline_children(task: Path) -> list[str]:
    """Children a thread of a process started (each thread lists its own)."""
    try:
        return (task / "children").read_text().split()
    except OSError:  # the thread ended
        return []


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone
        return b""
