"""Hosts stood in for by Linux network namespaces, for multi-host tests and benchmarks on one
machine: each host a namespace of its own with one veth into a bridge (in a namespace of its
own too), all on a private /24 of the benchmarking range 198.18.0.0/15 (RFC 2544), never routed
beyond this machine; this process's own namespace joins the bridge as one more address (the
client). A host's outgoing link can be shaped (`tc tbf`: a rate).

Needs root and `ip` (iproute2); `unavailable()` says why a machine cannot, so that a test skips
saying it. Everything made is removed on `close()` (deleting a namespace deletes its veths).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Sequence

NET_PREFIX = "198.18"  # RFC 2544's benchmarking range: nobody's real addresses


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise OSError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"pdprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except OSError as e:
        return f"cannot create a network namespace: {e}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


class Fabric:
    """Namespaced hosts named `hosts`, joined by a bridge; `address(host)` is its address,
    `client` this process's, `run_prefix(host)` what runs a command on it."""

    def __init__(self, hosts: Sequence[str]) -> None:
        tag = secrets.token_hex(2)
        self.subnet = f"{NET_PREFIX}.{int(tag, 16) % 256}"
        self._switch = f"pd{tag}sw"
        self._namespaces: dict[str, str] = {}
        self._links: dict[str, str] = {}  # host -> its veth (in its namespace)
        self._root_veth = f"pd{tag}c"
        self.client = f"{self.subnet}.1"
        self._addresses: dict[str, str] = {}
        try:
            _ip("netns", "add", self._switch)
            _ip("link", "add", "br0", "type", "bridge", netns=self._switch)
            _ip("link", "set", "br0", "up", netns=self._switch)
            self._join(self._root_veth, None, self.client)
            for i, host in enumerate(hosts):
                ns = f"pd{tag}{i}"
                _ip("netns", "add", ns)
                self._namespaces[host] = ns
                _ip("link", "set", "lo", "up", netns=ns)
                self._addresses[host] = f"{self.subnet}.{i + 2}"
                self._links[host] = f"pd{tag}h{i}"
                self._join(self._links[host], ns, self._addresses[host])
        except BaseException:
            self.close()
            raise

    def _join(self, name: str, netns: str | None, address: str) -> None:
        """A veth `name` in `netns` (None: ours) with `address`, its peer on the bridge."""
        peer = name + "b"
        _ip("link", "add", name, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", self._switch)
        _ip("link", "set", peer, "master", "br0", netns=self._switch)
        _ip("link", "set", peer, "up", netns=self._switch)
        if netns is not None:
            _ip("link", "set", name, "netns", netns)
        _ip("addr", "add", f"{address}/24", "dev", name, netns=netns)
        _ip("link", "set", name, "up", netns=netns)

    def address(self, host: str) -> str:
        return self._addresses[host]

    def run_prefix(self, host: str) -> list[str]:
        """Prefix of a command that runs it on `host` (exec'd in place: same process)."""
        return ["ip", "netns", "exec", self._namespaces[host]]

    def shape(self, host: str, rate: str) -> None:
        """Limit what `host` sends to `rate` (tc's notation: "1gbit"; a token bucket: netem's
        delays are not in every kernel)."""
        ns, dev = self._namespaces[host], self._links[host]
        burst = "1mb"  # >= rate / HZ for the rates a test uses (10 Gbit/s at HZ=1000: 1.25 MB)
        _tc(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
             "burst", burst, "latency", "100ms"])  # fmt: skip

    def unshape(self, host: str) -> None:
        ns, dev = self._namespaces[host], self._links[host]
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)

    def kill_all(self, host: str) -> None:
        """SIGKILL every process running on `host` (in its namespace), whoever started it."""
        inode = os.stat(f"/run/netns/{self._namespaces[host]}").st_ino
        for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
            try:
                if os.stat(f"/proc/{pid}/ns/net").st_ino == inode:
                    os.kill(pid, signal.SIGKILL)
            except OSError:  # gone, or not ours to see
                continue

    def close(self) -> None:
        """Every process on the hosts killed, every namespace and veth removed."""
        for host in list(self._namespaces):
            self.kill_all(host)
        for ns in [*self._namespaces.values(), self._switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self._root_veth], capture_output=True, timeout=30)
        self._namespaces.clear()

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tc(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise OSError(f"{' '.join(cmd)}: {done.stderr.strip()}")
