"""A fleet across hosts: prefill, decode and router each in a network namespace of its own
(joined by veth pairs on a bridge, private test addresses; `pdserve.bench.netns`), with the
cluster secret and TLS everywhere a byte crosses a "host": gRPC (decode -> prefill), HTTPS
(client -> router -> decode), the KV link's secret handshake (prefill -> decode). Routed
outputs equal the colocated engine's, and the KV crossed from the prefill's host to the
decode's; a peer on another host without the secret, with the wrong one, or without TLS is
refused on every plane. Skipped, saying why, where namespaces cannot be made (not root)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import secrets
import shlex
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import trustme
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench import netns
from pdserve.config import Secret
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.disagg.transport.handshake import HandshakeFailed
from tests.disagg.cluster import assert_clean, decode_stub, prefill_stub
from tests.disagg.kvfixtures import connect
from tests.helpers import logs_kept_on_failure, make_tiny_model, named_logs
from tests.router.test_router_e2e import BYTES, MODEL, Proc, reference

pytestmark = pytest.mark.slow

SECRET = Secret(b"a secret shared by the fleet's nodes")
WRONG = Secret(b"a secret this fleet has never seen")
PREFILL_GRPC, DECODE_HTTP, DECODE_GRPC, DECODE_KV, ROUTER_HTTP = 50051, 8000, 50052, 7000, 8080
RAY_PORT = 6379


@pytest.fixture(scope="module")
def fabric() -> Iterator[netns.Fabric]:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"hosts stood in for by network namespaces: {reason}")
    with netns.Fabric(["prefill", "decode", "router"]) as f:
        yield f


class Fleet:
    """The three nodes on their hosts, and what a client needs: the CA, the keys."""

    def __init__(self, fabric: netns.Fabric, model: Path, files: Path) -> None:
        self.fabric = fabric
        self.model = model
        p, d, r = (fabric.address(h) for h in ("prefill", "decode", "router"))
        ca = trustme.CA()
        self.ca = files / "ca.pem"
        ca.cert_pem.write_to_path(str(self.ca))
        tls = {}
        for host, address in (("prefill", p), ("decode", d), ("router", r)):
            cert = ca.issue_cert(address)
            chain, key = files / f"{host}.pem", files / f"{host}-key.pem"
            cert.cert_chain_pems[0].write_to_path(str(chain))
            cert.private_key_pem.write_to_path(str(key))
            tls[host] = ["--tls-cert", str(chain), "--tls-key", str(key)]
        secret, node_key, router_key = (
            files / n for n in ("secret", "node.apikey", "router.apikey")
        )
        secret.write_bytes(SECRET.value)
        self.node_key, self.router_key = "key-of-the-decodes", "key-of-the-router"
        node_key.write_text(self.node_key)
        router_key.write_text(self.router_key)
        for f in (secret, node_key, router_key):
            f.chmod(0o600)
        auth = ["--cluster-secret-file", str(secret)]
        common = ["--model", str(model), "--dtype", "float32", "--threads", "1", *auth]
        common += ["--kv-cache-memory", "32"]  # a tiny model: a small cache, a quick start
        self.prefill_grpc = f"{p}:{PREFILL_GRPC}"
        self.decode_grpc = f"{d}:{DECODE_GRPC}"
        self.decode_kv = f"{d}:{DECODE_KV}"
        self.decode_url = f"https://{d}:{DECODE_HTTP}"
        self.router_url = f"https://{r}:{ROUTER_HTTP}"
        prefill = ["prefill", *common, *tls["prefill"], "--grpc-host", p]
        prefill += ["--port", str(PREFILL_GRPC)]
        decode = ["serve", "--role", "decode", *common, *tls["decode"], "--tls-ca", str(self.ca)]
        decode += ["--host", d, "--port", str(DECODE_HTTP), "--api-key-file", str(node_key)]
        decode += ["--grpc-host", d, "--grpc-port", str(DECODE_GRPC)]
        decode += ["--transfer-host", d, "--transfer-port", str(DECODE_KV)]
        decode += ["--prefill", self.prefill_grpc, "--min-prefill-tokens", "1"]
        decode += ["--served-model-name", MODEL]
        router = ["router", *auth, *tls["router"], "--tls-ca", str(self.ca)]
        router += ["--host", r, "--port", str(ROUTER_HTTP), "--api-key-file", str(router_key)]
        router += ["--decode", self.decode_url, "--prefill", self.prefill_grpc]
        router += ["--node-api-key-file", str(node_key), "--tokenizer", str(model)]
        self.http = httpx.Client(verify=ssl.create_default_context(cafile=self.ca), timeout=60)
        self.procs = [Proc(prefill, "prefill", fabric.run_prefix("prefill"))]
        try:  # a node that does not start stops the others
            self.procs.append(Proc(decode, "decode", fabric.run_prefix("decode")))
            for proc in self.procs:
                proc.wait_for("ready")
            self.procs.append(Proc(router, "router", fabric.run_prefix("router")))
            self.procs[-1].wait_for("router ready")
        except BaseException:
            self.stop()
            raise

    def complete(self, prompt: list[int], max_tokens: int) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        r = self.http.post(
            f"{self.router_url}/v1/completions",
            json={**body, "ignore_eos": True},
            headers={"authorization": f"Bearer {self.router_key}"},
        )
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    def decode_metric(self, name: str, labels: dict[str, str]) -> float:
        r = self.http.get(
            f"{self.decode_url}/metrics", headers={"authorization": f"Bearer {self.node_key}"}
        )
        assert r.status_code == 200, r.text
        return sum(
            s.value
            for family in text_string_to_metric_families(r.text)
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.http.close()


@pytest.fixture(scope="module")
def fleet(
    fabric: netns.Fabric, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Fleet]:
    files = tmp_path_factory.mktemp("fleet")
    model = make_tiny_model(files / "tiny")
    fleet = Fleet(fabric, model, files)
    with logs_kept_on_failure(request, lambda: [p.log for p in fleet.procs]):
        try:
            yield fleet
        finally:
            fleet.stop()


def test_routed_requests_across_hosts_equal_colocated_and_kv_crosses_hosts(fleet: Fleet) -> None:
    prompts = [[3 + (11 * i + j) % 250 for j in range(24 + 5 * i)] for i in range(8)]
    expected = reference(fleet.model, prompts, 12)
    received = fleet.decode_metric(BYTES, {"direction": "received"})
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # several transfers at once
        texts = list(pool.map(lambda p: fleet.complete(p, 12), prompts))
    assert texts == expected
    # Every prompt was prefilled on the prefill's host: its KV came over the link.
    assert fleet.decode_metric(BYTES, {"direction": "received"}) > received
    assert fleet.decode_metric("pdserve:not_split_total", {}) == 0
    root = fleet.ca.read_bytes()
    assert_clean(
        decode_stub(fleet.decode_grpc, SECRET, root),
        prefill_stub(fleet.prefill_grpc, SECRET, root),
    )


def test_a_peer_on_another_host_without_the_secret_or_tls_is_refused(fleet: Fleet) -> None:
    root = fleet.ca.read_bytes()
    info = prefill_stub(fleet.prefill_grpc, SECRET, root).GetPeerInfo(pb.PeerInfoRequest())
    assert info.role == "prefill"  # the secret over TLS is served: the refusals below are not
    for secret in (None, WRONG):  # gRPC without the secret, or with another one
        with pytest.raises(grpc.RpcError) as e:
            prefill_stub(fleet.prefill_grpc, secret, root).GetPeerInfo(
                pb.PeerInfoRequest(), timeout=10
            )
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    plain = grpc.insecure_channel(fleet.prefill_grpc)  # gRPC without TLS: no channel at all
    with contextlib.closing(plain), pytest.raises(grpc.RpcError) as e:
        pb_grpc.PrefillServiceStub(plain).GetPeerInfo(pb.PeerInfoRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    refused = "pdserve:transfer_connections_total"
    before = fleet.decode_metric(refused, {"event": "handshake_failed"})
    for secret in (None, WRONG):  # a KV link that cannot prove the secret
        with pytest.raises((HandshakeFailed, ConnectionError)):
            connect(fleet.decode_kv, secret).close()
    assert fleet.decode_metric(refused, {"event": "handshake_failed"}) == before + 2
    body = {"model": MODEL, "prompt": "t5 t6", "max_tokens": 2}
    for url in (fleet.router_url, fleet.decode_url):  # HTTPS without a key, on either host
        r = fleet.http.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 401, r.text
    with pytest.raises(httpx.ConnectError):  # HTTPS that does not trust the fleet's CA
        httpx.post(f"{fleet.router_url}/v1/completions", json=body, timeout=10)


# ---- a Ray cluster whose nodes live on several hosts ----------------------------------------


class RayFleet:
    """`ray start` on namespaced hosts (head: the decode and the driver; each worker one
    prefill slot), with Ray's token authentication, each host's Ray files in a directory of its
    own, a dead host found within seconds; then `pdserve cluster --address` on it, 1 prefill +
    1 decode binding every address with the secret and TLS, the router on the head."""

    def __init__(self, hosts: netns.Fabric, workers: list[str], files: Path) -> None:
        self.hosts = hosts
        self.driver: Proc | None = None
        token = files / "ray.token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",  # a multi-node cluster on one machine
            # A host gone is found dead in ~3 s (Ray's default: ~15 s).
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
        }
        h = hosts.address("head")
        head = f"{h}:{RAY_PORT}"
        for host, resource, join in (
            ("head", "pd_decode", ["--head", "--port", str(RAY_PORT)]),
            *((w, "pd_prefill", ["--address", head]) for w in workers),
        ):
            temp = tempfile.mkdtemp(prefix=f"ray-{host}-")
            # The `ray` of this interpreter's environment (CI does not put it on PATH).
            ray = str(Path(sys.executable).with_name("ray"))
            cmd = [*hosts.run_prefix(host), ray, "start", *join, "--temp-dir", temp]
            cmd += ["--node-ip-address", hosts.address(host), "--num-cpus", "2"]
            cmd += ["--resources", json.dumps({resource: 1}), "--disable-usage-stats"]
            cmd += ["--include-dashboard", "false"] if host == "head" else []
            done = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=120)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        self.model = make_tiny_model(files / "tiny")
        ca = trustme.CA()
        cert = ca.issue_cert(h, *(hosts.address(w) for w in workers))
        self.files = {n: files / n for n in ("ca.pem", "cert.pem", "key.pem", "secret", "nk")}
        self.files["rk"] = files / "rk"
        ca.cert_pem.write_to_path(str(self.files["ca.pem"]))
        cert.cert_chain_pems[0].write_to_path(str(self.files["cert.pem"]))
        cert.private_key_pem.write_to_path(str(self.files["key.pem"]))
        self.files["secret"].write_bytes(SECRET.value)
        self.files["nk"].write_text("key-of-the-decodes")
        self.files["rk"].write_text("key-of-the-router")
        for f in self.files.values():
            f.chmod(0o600)
        f = {k: str(v) for k, v in self.files.items()}
        node_args = [
            *["--model", str(self.model), "--dtype", "float32", "--threads", "1"],
            *["--kv-cache-memory", "32"],  # a tiny model: a small cache, a quick start
            *["--served-model-name", MODEL, "--min-prefill-tokens", "1"],
            *["--grpc-host", "0.0.0.0", "--transfer-host", "0.0.0.0", "--host", "0.0.0.0"],
            *["--cluster-secret-file", f["secret"], "--tls-ca", f["ca.pem"]],
            *["--tls-cert", f["cert.pem"], "--tls-key", f["key.pem"], "--api-key-file", f["nk"]],
        ]
        cmd = ["cluster", "--address", head, "--num-prefill", "1", "--num-decode", "1"]
        cmd += ["--cpus-per-node", "0", "--node-args", shlex.join(node_args)]
        cmd += ["--prefill-resource", "pd_prefill", "--decode-resource", "pd_decode"]
        cmd += ["--policy", "round_robin", "--host", h, "--port", str(ROUTER_HTTP)]
        cmd += ["--api-key-file", f["rk"], "--node-api-key-file", f["nk"]]
        cmd += ["--cluster-secret-file", f["secret"]]  # the router probes the prefill nodes
        cmd += ["--tls-ca", f["ca.pem"], "--tls-cert", f["cert.pem"], "--tls-key", f["key.pem"]]
        self.driver = Proc(cmd, "cluster", hosts.run_prefix("head"), env=self.env)
        try:
            self.driver.wait_for("pdserve cluster ready", timeout_s=300)
        except BaseException:
            self.driver.stop()
            raise
        ready = self.driver.log.read_text()
        self.decode = re.search(r"decodes=(\S+)", ready).group(1)  # type: ignore[union-attr]
        self.prefill = re.search(r"prefills=(\S+)", ready).group(1)  # type: ignore[union-attr]
        self.router = f"https://{h}:{ROUTER_HTTP}"
        verify = ssl.create_default_context(cafile=self.files["ca.pem"])
        self.http = httpx.Client(verify=verify, timeout=60)

    def complete(self, prompts: list[list[int]]) -> list[str]:
        texts = []
        for prompt in prompts:
            r = self.http.post(
                f"{self.router}/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": 10,
                    "temperature": 0,
                    "ignore_eos": True,
                },  # fmt: skip
                headers={"authorization": "Bearer key-of-the-router"},
            )
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        return texts

    def metric(self, url: str, name: str, labels: dict[str, str]) -> float:
        key = "key-of-the-decodes" if url == self.decode else "key-of-the-router"
        text = self.http.get(f"{url}/metrics", headers={"authorization": f"Bearer {key}"}).text
        return sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def stop(self) -> None:
        self.http.close()
        if self.driver is not None:
            self.driver.stop()


@pytest.fixture
def ray_hosts(fabric: netns.Fabric, request: pytest.FixtureRequest) -> Iterator[netns.Fabric]:
    """Hosts of their own for a Ray cluster (everything on them killed afterwards); `fabric`
    only says whether namespaces can be made."""
    hosts = netns.Fabric(["head", "worker1", "worker2"])
    try:
        yield hosts
    finally:
        hosts.close()


def test_a_ray_cluster_across_hosts_serves_disaggregated(
    ray_hosts: netns.Fabric, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """`pdserve cluster --address` on a Ray cluster of two namespaced hosts: the decode on the
    head, the prefill on the worker, both binding every address with the secret and TLS. The
    decode tells the prefill its host's address (not the wildcard), the KV crosses the hosts,
    and routed outputs equal colocated."""
    fleet: RayFleet | None = None
    try:
        fleet = RayFleet(ray_hosts, ["worker1"], tmp_path)
        h, w = ray_hosts.address("head"), ray_hosts.address("worker1")
        assert re.match(rf"https://{re.escape(h)}:\d+$", fleet.decode), fleet.decode
        assert re.match(rf"{re.escape(w)}:\d+$", fleet.prefill), fleet.prefill
        prompts = [[3 + (13 * i + j) % 250 for j in range(20 + 4 * i)] for i in range(6)]
        assert fleet.complete(prompts) == reference(fleet.model, prompts, 10)
        # The prompts' KV came from the worker host.
        assert fleet.metric(fleet.decode, BYTES, {"direction": "received"}) > 0
        assert fleet.metric(fleet.decode, "pdserve:not_split_total", {}) == 0
    finally:
        with logs_kept_on_failure(request, lambda: named_logs(fleet.driver.log) if fleet else []):
            if fleet is not None:
                fleet.stop()


def test_a_prefill_node_restarted_on_another_host_is_found_again(
    ray_hosts: netns.Fabric, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The prefill's host dies (everything on it killed): Ray restarts its actor on the other
    worker, at that host's address; the driver finds it there and tells the router, which tells
    the decode, and prompts are prefilled remotely again, on the new host, outputs unchanged."""
    fleet: RayFleet | None = None
    try:
        fleet = RayFleet(ray_hosts, ["worker1", "worker2"], tmp_path)
        ips = {ray_hosts.address(w): w for w in ("worker1", "worker2")}
        first = ips[fleet.prefill.rsplit(":", 1)[0]]
        prompts = [[3 + (7 * i + j) % 250 for j in range(24 + 3 * i)] for i in range(4)]
        expected = reference(fleet.model, prompts, 10)
        assert fleet.complete(prompts[:2]) == expected[:2]
        ray_hosts.kill_all(first)  # the host is gone, its Ray node with it
        fleet.driver.wait_for(r"pdserve cluster node moved", timeout_s=180)  # type: ignore[union-attr]
        moved = re.search(r"node moved (\S+) -> (\S+)", fleet.driver.log.read_text())  # type: ignore[union-attr]
        assert moved is not None and moved.group(1) == fleet.prefill
        new = moved.group(2)
        assert ips[new.rsplit(":", 1)[0]] != first  # on the other worker, same port
        assert new.rsplit(":", 1)[1] == fleet.prefill.rsplit(":", 1)[1]
        received = fleet.metric(fleet.decode, BYTES, {"direction": "received"})
        local = fleet.metric(fleet.decode, "pdserve:not_split_total", {})
        deadline = time.monotonic() + 60  # the decode probes the new node before using it
        while fleet.complete(prompts[2:3]) != expected[2:3] or (
            fleet.metric(fleet.decode, BYTES, {"direction": "received"}) == received
        ):
            assert time.monotonic() < deadline, "never prefilled on the new host"
            time.sleep(0.5)
        received = fleet.metric(fleet.decode, BYTES, {"direction": "received"})
        local = fleet.metric(fleet.decode, "pdserve:not_split_total", {})
        assert fleet.complete(prompts[3:]) == expected[3:]
        assert fleet.metric(fleet.decode, BYTES, {"direction": "received"}) > received
        assert fleet.metric(fleet.decode, "pdserve:not_split_total", {}) == local
        routed = "pdserve:router_requests_total"
        assert fleet.metric(fleet.router, routed, {"prefill": new}) >= 1
        # The decode's node killed: Ray starts it again with the flags it was first given
        # (the old prefill address); the router, finding it back, tells it again.
        pid = re.search(r"node decode pid=(\d+)", fleet.driver.log.read_text())  # type: ignore[union-attr]
        assert pid is not None
        os.kill(int(pid.group(1)), signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # its counters start again from 0: any KV it receives came from `new`
            try:
                again = fleet.complete(prompts[:1])
                if fleet.metric(fleet.decode, BYTES, {"direction": "received"}) > 0:
                    break
            except (AssertionError, httpx.HTTPError):
                pass  # not back yet
            assert time.monotonic() < deadline, "the restarted decode never used the new host"
            time.sleep(0.5)
        assert again == expected[:1]
    finally:
        with logs_kept_on_failure(request, lambda: named_logs(fleet.driver.log) if fleet else []):
            if fleet is not None:
                fleet.stop()
