"""A pdserve node as a Ray actor: the actor runs `pdserve serve --role ROLE` as its child
process on whatever Ray node placed it, and lives exactly as long as that child. A decode
that binds every address (`--transfer-host 0.0.0.0`) tells prefill nodes its Ray node's address.

Lifecycle: Ray creates the actor -> `__init__` starts the child on the actor's fixed ports and
waits for its "ready" line (bounded) -> `info` answers what it serves -> `restart` (a rolling
restart) stops the child gracefully and starts it again, the actor living on -> if the child exits,
or stays up but answers its /health with 503 (after start-up, a node says that only when it is
broken for good, e.g. its tensor-parallel group lost a rank), a watcher thread ends the child
and the actor's process, so Ray's restart policy (`max_restarts`) starts a new actor, which
starts the node again on the same ports. The child gets SIGKILL if the actor
process dies first (PR_SET_PDEATHSIG), so a killed actor never leaves a node behind. KV never
travels through Ray: the nodes move it over pdserve's own transport.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.config import is_wildcard
from pdserve.serve.launcher import health_status

READY_TIMEOUT_S = 300.0
HEALTH_POLL_S = 1.0  # how often the watcher asks a running node whether it is broken
PR_SET_PDEATHSIG = 1


def _ray_node_ip() -> str:
    import ray.util

    return str(ray.util.get_node_ip_address())


def _says_broken(url: str) -> bool:
    """Whether the node answers its /health with 503. No answer is not "broken": a busy node
    may be slow to answer, and a dead one is the process watcher's to see."""
    return health_status(url) == 503


def _wildcard_bind(args: list[str]) -> bool:
    """Whether the node's KV receiver binds every address (`--transfer-host 0.0.0.0`)."""
    hosts = [b for a, b in zip(args, args[1:], strict=False) if a == "--transfer-host"]
    return bool(hosts) and is_wildcard(hosts[-1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class NodeActor:
    """Wrapped with `ray.remote` by the cluster runner (this module does not import Ray)."""

    def __init__(
        self,
        role: str,
        args: list[str],
        host: str | None,
        on_node_gone: Callable[[], None] = lambda: os._exit(1),
    ) -> None:
        self.role = role
        # What ends the actor once its node is gone (Ray then restarts it); tests pass their own.
        self._on_node_gone = on_node_gone
        # The address other nodes and the router reach this one at: the Ray node's by default.
        self.host = host or _ray_node_ip()
        if role == "decode" and _wildcard_bind(args) and "--advertise-host" not in args:
            args = [*args, "--advertise-host", self.host]  # prefill nodes push KV here
        self._cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "INFO", "serve"]
        self._cmd += ["--role", role, *args]
        self._stopping = False
        self._restarting = False  # the node is being restarted on purpose (`restart`)
        self._start()
        threading.Thread(target=self._watch, name="node-watch", daemon=True).start()

    def _start(self) -> None:
        """Start the node (a log of its own each time) and wait for its "ready" line."""
        self.log = Path(tempfile.mkstemp(prefix=f"pdserve-{self.role}-actor-", suffix=".log")[1])
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                self._cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        self._wait_ready()

    def restart(self) -> dict[str, Any]:
        """Stop the node gracefully and start it again, same flags and ports (one step of a
        rolling restart: the router drained it first); what it serves now. The actor lives on.
        """
        self._restarting = True
        try:
            self._end_node()
            if self.proc.returncode == 0:
                self.log.unlink(missing_ok=True)
            self._start()
        finally:
            self._restarting = False
        return self.info()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not re.search(rf"pdserve {self.role} ready", self.log.read_text()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(
                    f"{self.role} node did not start:\n{self.log.read_text()[-2000:]}"
                )
            time.sleep(0.1)

    def _watch(self) -> None:
        health = self.info().get("http")
        while True:
            proc = self.proc
            try:
                proc.wait(HEALTH_POLL_S)
            except subprocess.TimeoutExpired:
                busy = self._stopping or self._restarting
                if health and not busy and _says_broken(f"{health}/health"):
                    print(f"pdserve {self.role} node reports itself broken; ending it", flush=True)
                    self._end_node()
                continue
            if self._stopping:
                return
            if self._restarting or self.proc is not proc:  # restarted on purpose: watch anew
                while self._restarting:
                    time.sleep(0.05)
                health = self.info().get("http")  # a port chosen at start may have changed
                continue
            self._on_node_gone()  # the node is gone: so is the actor, and Ray restarts it
            return

    def info(self) -> dict[str, Any]:
        """What the node serves (from its ready line), its pid and log."""
        line = re.search(rf"pdserve {self.role} ready (.*)", self.log.read_text())
        parts = dict(p.split("=", 1) for p in (line.group(1).split() if line else []))
        for key, value in parts.items():  # a wildcard bind is reached at the node's address
            parts[key] = re.sub(r"(?<=//)0\.0\.0\.0(?=:)|^0\.0\.0\.0(?=:)", self.host, value)
        return {"pid": self.proc.pid, "log": str(self.log), **parts}

    def stop(self) -> None:
        """Stop the node for good (the caller then kills the actor without restart). Its log
        is removed if it exited cleanly, and kept for its reader if not."""
        self._stopping = True
        self._end_node()
        if self.proc.returncode == 0:
            self.log.unlink(missing_ok=True)

    def _end_node(self) -> None:
        """SIGTERM (what runs fails as "shutting down"), SIGKILL after a grace period."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
