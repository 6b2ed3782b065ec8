"""`pdserve cluster` on a local Ray cluster advertising 127.0.0.1 only: 2 prefill and 2 decode
nodes as Ray actors (tiny random model) behind the router. Outputs equal the colocated
engine's over 32 requests; a killed decode node stops receiving requests within 2 s while
requests keep succeeding, Ray restarts it and it takes traffic again; a killed prefill node
costs no request (decode uses the other); afterwards no node holds a block or a transfer; a
SIGTERM to the driver leaves no process behind. A rolling restart (SIGHUP) under streaming load
fails no request."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.sequence import SamplingParams
from tests.disagg.cluster import free_port
from tests.helpers import logs_kept_on_failure, make_engine, make_tiny_model, named_logs

pytestmark = pytest.mark.slow

MODEL = "tiny"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class RayCluster:
    def __init__(self, model: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="pdserve-cluster-", suffix=".log")[1])
        # each node's KV cache small (the default 512 MiB each, pre-faulted, brought the host to
        # Ray's memory limit beside another test worker, and Ray killed the actors)
        node_args = (
            f"--model {model} --dtype float32 --threads 1 --served-model-name {MODEL} "
            "--kv-cache-memory 32"
        )
        cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "INFO", "cluster"]
        cmd += ["--num-prefill", "2", "--num-decode", "2", "--cpus-per-node", "0"]
        cmd += ["--node-args", node_args + " --min-prefill-tokens 1", "--policy", "round_robin"]
        cmd += ["--port", str(self.port), "--prefill-port-base", str(free_port())]
        cmd += ["--decode-port-base", str(free_port())]
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while not (ready := re.search(r"pdserve cluster ready .*", self.log.read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(self.log.read_text()[-3000:])
            time.sleep(0.2)
        fields = dict(p.split("=", 1) for p in ready.group(0).split()[3:])
        self.decodes = fields["decodes"].split(",")
        self.prefills = fields["prefills"].split(",")
        line = r"pdserve cluster node (\w+) pid=(\d+) log=(\S+) .*http=(\S+)"
        nodes = re.findall(line, self.log.read_text())
        self.pids = {
            r: [int(p) for role, p, _, _ in nodes if role == r] for r in ("prefill", "decode")
        }
        self.logs = {
            r: [Path(log) for role, _, log, _ in nodes if role == r] for r in ("prefill", "decode")
        }
        self.prefill_http = [url for role, _, _, url in nodes if role == "prefill"]
        self.http = httpx.Client(timeout=60)

    def complete(self, prompt: list[int]) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        r = self.http.post(f"{self.url}/v1/completions", json={**body, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    def metric(self, url: str, name: str, labels: dict[str, str] | None = None) -> float:
        text = self.http.get(f"{url}/metrics").text
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items())
        )

    def routed_to(self, decode: str) -> float:
        return self.metric(self.url, "pdserve:router_requests_total", {"decode": decode})

    def assert_idle(self, url: str, within_s: float = 2.0) -> None:
        """No block in use, no transfer or receive entry left on the node."""
        gauges = ("kv_blocks_used", "pending_transfers", "resource_store_entries")
        deadline = time.monotonic() + within_s
        while left := {g: v for g in gauges if (v := self.metric(url, f"pdserve:{g}"))}:
            assert time.monotonic() < deadline, f"{url} still holds {left}"
            time.sleep(0.1)

    def healthy(self) -> list[str]:
        return list(self.http.get(f"{self.url}/health").json()["decodes"])

    def all_pids(self) -> list[int]:
        """The driver's descendants (Ray's processes, the actors and their nodes)."""
        out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True)
        children: dict[int, list[int]] = {}
        for line in out.stdout.split("\n"):
            if line.strip():
                pid, ppid = map(int, line.split())
                children.setdefault(ppid, []).append(pid)
        found, todo = [], [self.proc.pid]
        while todo:
            for child in children.get(todo.pop(), []):
                found.append(child)
                todo.append(child)
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.http.close()


@pytest.fixture
def ray_cluster(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[RayCluster, Path]]:
    model = make_tiny_model(tmp_path / "tiny")
    cluster = RayCluster(model)
    with logs_kept_on_failure(request, lambda: named_logs(cluster.log)):
        try:
            yield cluster, model
        finally:
            cluster.stop()


def test_ray_cluster_serves_restarts_a_killed_node_and_stops_clean(
    ray_cluster: tuple[RayCluster, Path],
) -> None:
    cluster, model = ray_cluster
    prompts = [[3 + (5 * i + j) % 250 for j in range(18 + i)] for i in range(32)]
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * len(prompts)
    expected = [o.text for o in make_engine(model).generate(prompts, params)]
    assert [cluster.complete(p) for p in prompts[:16]] == expected[:16]

    # A decode node dies: within 2 s the router stops routing to it; requests keep succeeding.
    untouched = cluster.pids["decode"][1:] + cluster.pids["prefill"][1:]
    killed = cluster.decodes[0]
    os.kill(cluster.pids["decode"][0], signal.SIGKILL)
    killed_at = time.monotonic()
    while killed in cluster.healthy():
        assert time.monotonic() - killed_at < 2.0, "the router still routes to the dead decode"
        time.sleep(0.05)
    assert [cluster.complete(p) for p in prompts[16:20]] == expected[16:20]
    # Ray restarts its actor, which starts the node again; the router re-admits it.
    while killed not in cluster.healthy():
        assert time.monotonic() - killed_at < 120, "the killed decode did not come back"
        time.sleep(0.2)
    before = cluster.routed_to(killed)
    assert [cluster.complete(p) for p in prompts[20:24]] == expected[20:24]
    assert cluster.routed_to(killed) > before  # it takes traffic again

    # A prefill node dies: decodes use the other one.
    os.kill(cluster.pids["prefill"][0], signal.SIGKILL)
    assert [cluster.complete(p) for p in prompts[24:]] == expected[24:]
    # Nothing leaks: every decode and the surviving prefill hold no block and no transfer.
    for url in [*cluster.decodes, *cluster.prefill_http[1:]]:
        cluster.assert_idle(url)

    descendants = cluster.all_pids()
    assert set(untouched) <= set(descendants)  # the nodes never killed, under the driver
    cluster.stop()
    assert cluster.proc.returncode == 0, cluster.log.read_text()[-3000:]
    # Every node still up stopped gracefully (its actor removes the log of a clean exit), even
    # with the killed prefill's actor restarting meanwhile; the killed nodes' logs are kept.
    graceful = cluster.logs["decode"][1:] + cluster.logs["prefill"][1:]
    assert not [log for log in graceful if log.exists()], cluster.log.read_text()[-3000:]
    assert cluster.logs["decode"][0].exists() and cluster.logs["prefill"][0].exists()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in descendants):
        assert time.monotonic() < deadline, [p for p in descendants if alive(p)]
        time.sleep(0.2)


def stream_text(url: str, prompt: list[int]) -> str:
    """One streamed completion's text; raises on anything but a whole, error-free stream."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    text, done = [], False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                text += [c["text"] for c in event["choices"]]
    assert done
    return "".join(text)


def test_a_rolling_restart_under_load_fails_no_request(
    ray_cluster: tuple[RayCluster, Path],
) -> None:
    """SIGHUP to the driver restarts every node, one at a time (decodes drained first, their
    streams going on from the other; prefills taken out of the router's choices) while 4
    clients stream without pause: every request succeeds with the colocated engine's text,
    and every node runs as a new process afterwards."""
    cluster, model = ray_cluster
    prompts = [[3 + (7 * i + j) % 250 for j in range(16 + i % 9)] for i in range(12)]
    params = [SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)] * len(prompts)
    expected = [o.text for o in make_engine(model).generate(prompts, params)]
    before = set(cluster.all_pids())
    restarted = threading.Event()
    results: list[tuple[int, str | BaseException]] = []

    def client(k: int) -> None:
        i = k
        while not restarted.is_set():
            try:
                results.append((i, stream_text(cluster.url, prompts[i])))
            except BaseException as e:  # reported below with the request's index
                results.append((i, e))
            i = (i + 4) % len(prompts)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(client, k) for k in range(4)]
        time.sleep(1.0)  # under load
        cluster.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 300
        while "rolling restart done nodes=4" not in cluster.log.read_text():
            assert time.monotonic() < deadline, cluster.log.read_text()[-3000:]
            assert cluster.proc.poll() is None, cluster.log.read_text()[-3000:]
            time.sleep(0.2)
        restarted.set()
        for c in clients:
            c.result(120)
    failed = [(i, r) for i, r in results if isinstance(r, BaseException)]
    assert not failed, failed[:3]
    assert all(text == expected[i] for i, text in results)
    assert len(results) >= 8
    # Every node is a new process (the actors lived on: Ray restarted none of them).
    for pid in cluster.pids["decode"] + cluster.pids["prefill"]:
        assert not alive(pid)
    assert len(cluster.healthy()) == 2
    assert len(set(cluster.all_pids()) - before) >= 4
