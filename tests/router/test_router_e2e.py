"""`pdserve router` in front of 2 prefill and 2 decode nodes, all real processes on loopback
with a tiny random model: outputs token-identical to the colocated engine, every node used,
`cache_aware` sending a request that shares a long prefix to the nodes that hold it (decode
receives only the tail), and a killed decode or prefill costing no request."""

from __future__ import annotations

import concurrent.futures
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.api.protocol import PREFILL_HEADER
from pdserve.engine.sequence import SamplingParams
from tests.disagg.cluster import free_port
from tests.helpers import logs_kept_on_failure, make_engine, make_tiny_model

pytestmark = pytest.mark.slow

MODEL = "tiny"
BYTES = "pdserve:transfer_bytes_total"


class Proc:
    """A pdserve process whose log is kept; stopped with SIGTERM (then SIGKILL). `prefix`
    runs it elsewhere (in a network namespace: `ip netns exec NS`, which execs in place)."""

    def __init__(
        self,
        args: list[str],
        name: str,
        prefix: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.log = Path(tempfile.mkstemp(prefix=f"pdserve-{name}-", suffix=".log")[1])
        cmd = [*prefix, sys.executable, "-m", "pdserve.cli", "--log-level", "INFO", *args]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_for(self, pattern: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, self.log.read_text()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no {pattern!r} in:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.signal(sig)
        self.wait_stopped()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_stopped(self) -> None:
        """After a signal: its exit, or SIGKILL after 20 s."""
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_pd_fleet(
    procs: list[Proc],
    model: Path,
    flags: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> tuple[str, str, str]:
    """A prefill node, a decode splitting every prompt to it and a router in front, each with
    `flags` too (every process takes them), added to `procs` (which the caller stops) and
    ready: (router URL, decode URL, prefill address)."""
    common = ["--model", str(model), "--dtype", "float32", "--threads", "1", *flags]
    prefill = f"127.0.0.1:{free_port()}"
    decode = f"http://127.0.0.1:{free_port()}"
    router = f"http://127.0.0.1:{free_port()}"
    procs.append(
        Proc(["prefill", *common, "--port", prefill.rsplit(":", 1)[1]], "prefill", env=env)
    )
    args = ["serve", "--role", "decode", *common, "--port", decode.rsplit(":", 1)[1]]
    args += ["--grpc-port", "0", "--transfer-port", "0", "--min-prefill-tokens", "1"]
    args += ["--served-model-name", MODEL, "--prefill", prefill]
    procs.append(Proc(args, "decode", env=env))
    for p in procs[-2:]:
        p.wait_for("ready")
    args = ["router", "--decode", decode, "--prefill", prefill, *flags]
    args += ["--port", router.rsplit(":", 1)[1]]
    procs.append(Proc(args, "router", env=env))
    procs[-1].wait_for("router ready")
    return router, decode, prefill


class Cluster:
    def __init__(self, model: Path, policy: str) -> None:
        self.procs: list[Proc] = []
        common = ["--model", str(model), "--dtype", "float32", "--threads", "1"]
        policy, _, events = policy.partition("+")
        # Following KV events: decodes behind an API key, /metrics too (the router's own
        # calls then need its --node-api-key).
        self.key = "router-test-key" if events else None
        locked = ["--api-key", self.key, "--api-key-metrics"] if self.key else []
        self.prefills = [f"127.0.0.1:{free_port()}" for _ in range(2)]
        self.decodes = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        self.router = f"http://127.0.0.1:{free_port()}"
        for address in self.prefills:
            port = address.rsplit(":", 1)[1]
            self.procs.append(Proc(["prefill", *common, "--port", port], "prefill"))
        peers = [a for p in self.prefills for a in ("--prefill", p)]
        for url in self.decodes:
            port = url.rsplit(":", 1)[1]
            args = ["serve", "--role", "decode", *common, "--port", port, "--grpc-port", "0"]
            args += ["--transfer-port", "0", "--min-prefill-tokens", "1"]
            args += ["--served-model-name", MODEL, *peers, *locked]
            self.procs.append(Proc(args, "decode"))
        for p in self.procs:
            p.wait_for("ready")
        decodes = [a for u in self.decodes for a in ("--decode", u)]
        port = self.router.rsplit(":", 1)[1]
        router = ["router", *decodes, *peers, "--policy", policy, "--port", port]
        if events:  # the router follows the decodes' KV events (it knows their tokenizer)
            router += ["--tokenizer", str(model), "--node-api-key", "router-test-key"]
        self.procs.append(Proc(router, "router"))
        self.procs[-1].wait_for("router ready")
        auth = {"authorization": f"Bearer {self.key}"} if self.key else {}
        self.http = httpx.Client(timeout=60, headers=auth)

    def complete(self, prompt: list[int], max_tokens: int, url: str | None = None) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        r = self.http.post(
            f"{url or self.router}/v1/completions", json={**body, "ignore_eos": True}
        )
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    def metric(self, url: str, name: str, labels: dict[str, str] | None = None) -> float:
        total = 0.0
        for family in text_string_to_metric_families(self.http.get(f"{url}/metrics").text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                    total += s.value
        return total

    def stop(self) -> None:
        for p in reversed(self.procs):  # all at once: their shutdowns overlap
            p.signal(signal.SIGTERM)
        for p in self.procs:
            p.wait_stopped()
        self.http.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def cluster(model: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(model, request.param)
    with logs_kept_on_failure(request, lambda: [p.log for p in c.procs]):
        try:
            yield c
        finally:
            c.stop()


def reference(model: Path, prompts: list[list[int]], max_tokens: int) -> list[str]:
    engine = make_engine(model)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)] * len(prompts)
    return [o.text for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("cluster", ["round_robin"], indirect=True)
def test_routed_requests_equal_colocated_and_a_killed_node_costs_none(
    cluster: Cluster, model: Path
) -> None:
    prompts = [[3 + (7 * i + j) % 250 for j in range(20 + 3 * i)] for i in range(32)]
    expected = reference(model, prompts, 12)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: cluster.complete(p, 12), prompts))
    assert got == expected
    # What any decode answers alike passes through: /tokenize, /detokenize, /v1/models.
    tok = make_engine(model).tokenizer
    r = cluster.http.post(f"{cluster.router}/tokenize", json={"model": MODEL, "prompt": "t5 t9"})
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode("t5 t9")
    r = cluster.http.post(f"{cluster.router}/detokenize", json={"model": MODEL, "tokens": [5, 9]})
    assert r.status_code == 200 and r.json()["prompt"] == tok.decode([5, 9])
    assert cluster.http.get(f"{cluster.router}/v1/models").json()["data"][0]["id"] == MODEL
    routed = "pdserve:router_requests_total"
    for d in cluster.decodes:
        assert cluster.metric(cluster.router, routed, {"decode": d}) == 16
    for p in cluster.prefills:
        assert cluster.metric(cluster.router, routed, {"prefill": p}) == 16
    # Both decodes really prefilled remotely: KV arrived on each.
    for d in cluster.decodes:
        assert cluster.metric(d, BYTES, {"direction": "received"}) > 0

    # A decode killed: a request routed there before the router notices is retried on the
    # other; within 2 s the router stops routing to it.
    decode_procs = [p for p in cluster.procs if "decode" in p.log.name]
    decode_procs[0].stop(signal.SIGKILL)
    killed_at = time.monotonic()
    again = prompts[:12]
    assert [cluster.complete(p, 12) for p in again[:4]] == expected[:4]
    while cluster.http.get(f"{cluster.router}/health").json()["decodes"] != cluster.decodes[1:]:
        assert time.monotonic() - killed_at < 2.0, "the router still routes to the dead decode"
        time.sleep(0.05)
    assert cluster.metric(cluster.router, "pdserve:router_retries_total") <= 1
    # A prefill killed: the decode uses the other prefill node for the ones routed there, and
    # within 2 s the router stops choosing it.
    prefill_procs = [p for p in cluster.procs if "prefill" in p.log.name]
    prefill_procs[0].stop(signal.SIGKILL)
    killed_at = time.monotonic()
    assert [cluster.complete(p, 12) for p in again[4:]] == expected[4:12]
    while cluster.http.get(f"{cluster.router}/health").json()["prefills"] != cluster.prefills[1:]:
        assert time.monotonic() - killed_at < 2.0, "the router still routes to the dead prefill"
        time.sleep(0.05)
    before = cluster.metric(cluster.router, routed, {"prefill": cluster.prefills[0]})
    assert [cluster.complete(p, 12) for p in prompts[12:16]] == expected[12:16]
    assert cluster.metric(cluster.router, routed, {"prefill": cluster.prefills[0]}) == before


@pytest.mark.parametrize("cluster", ["cache_aware"], indirect=True)
def test_cache_aware_sends_a_shared_prefix_where_it_is_cached(cluster: Cluster) -> None:
    shared = [3 + (11 * j) % 250 for j in range(160)]  # 10 blocks of 16 tokens
    cluster.complete(shared + [7, 8, 9], 4)
    received = {d: cluster.metric(d, BYTES, {"direction": "received"}) for d in cluster.decodes}
    holder = [d for d, n in received.items() if n > 0]
    assert len(holder) == 1
    # An unrelated request in between (wherever it goes), then the shared prefix again.
    cluster.complete([200 - j for j in range(40)], 4)
    before = cluster.metric(holder[0], BYTES, {"direction": "received"})
    cluster.complete(shared + [10, 11, 12, 13], 4)
    tail = cluster.metric(holder[0], BYTES, {"direction": "received"}) - before
    skipped = cluster.metric(holder[0], BYTES, {"direction": "skipped"})
    routed = "pdserve:router_requests_total"
    assert cluster.metric(cluster.router, routed, {"decode": holder[0]}) >= 2
    # The second time only the tail moved (one block): the 10 shared blocks were already here.
    assert skipped > 0 and tail == skipped / 10


@pytest.mark.parametrize("cluster", ["cache_aware+kv_events"], indirect=True)
def test_cache_aware_follows_kv_events_to_a_cache_it_did_not_fill(cluster: Cluster) -> None:
    """A decode's cache filled by a request that did not pass the router: the router learns it
    from that decode's KV events and sends the next request with the prefix there (without
    events it would pick the first decode: nothing routed yet, both idle). The decodes want an
    API key, for /metrics and /kv_events too: the router reads both with its own key, and a
    client's request without one is refused (the router never lends its key)."""
    shared = [3 + (13 * j) % 250 for j in range(160)]  # 10 blocks of 16 tokens
    holder = cluster.decodes[1]
    cluster.complete(shared + [7, 8, 9], 4, url=holder)
    deadline = time.monotonic() + 30
    while cluster.metric(cluster.router, "pdserve:router_kv_blocks", {"decode": holder}) < 10:
        assert time.monotonic() < deadline, "the router never saw the decode's KV events"
        time.sleep(0.1)
    hits = "vllm:prefix_cache_hits_total"
    before = cluster.metric(holder, hits)
    cluster.complete(shared + [10, 11, 12, 13], 4)
    routed = "pdserve:router_requests_total"
    assert cluster.metric(cluster.router, routed, {"decode": holder}) == 1
    assert cluster.metric(cluster.router, routed, {"decode": cluster.decodes[0]}) == 0
    assert cluster.metric(holder, hits) - before == 160  # its 10 cached blocks were reused
    body = {"model": MODEL, "prompt": shared, "max_tokens": 1}
    keyless = httpx.post(f"{cluster.router}/v1/completions", json=body, timeout=30)
    assert keyless.status_code == 401, keyless.text


@pytest.mark.parametrize("cluster", ["cache_aware+kv_events"], indirect=True)
def test_cache_aware_follows_a_prefill_nodes_kv_events(cluster: Cluster) -> None:
    """A prefill node's cache filled by a request that did not pass the router (a decode asked
    for that node itself): the router learns it from the node's `GetKVEvents` and sends the next
    request with the prefix to that prefill node (without its events: to the first one, nothing
    routed yet, both idle)."""
    shared = [3 + (17 * j) % 250 for j in range(160)]  # 10 blocks of 16 tokens
    holder = cluster.prefills[1]
    body = {"model": MODEL, "prompt": shared + [7, 8, 9], "max_tokens": 4, "temperature": 0}
    r = cluster.http.post(
        f"{cluster.decodes[0]}/v1/completions", json=body, headers={PREFILL_HEADER: holder}
    )
    assert r.status_code == 200, r.text
    kv_blocks = "pdserve:router_prefill_kv_blocks"
    deadline = time.monotonic() + 30
    while cluster.metric(cluster.router, kv_blocks, {"prefill": holder}) < 10:
        assert time.monotonic() < deadline, "the router never saw the prefill node's KV events"
        time.sleep(0.1)
    assert cluster.metric(cluster.router, kv_blocks, {"prefill": cluster.prefills[0]}) == 0
    cluster.complete(shared + [10, 11, 12, 13], 4)
    routed = "pdserve:router_requests_total"
    assert cluster.metric(cluster.router, routed, {"prefill": holder}) == 1
    assert cluster.metric(cluster.router, routed, {"prefill": cluster.prefills[0]}) == 0


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 whose windowed layer sees 24 positions: the prompts here run past it."""
    return make_tiny_model(tmp_path_factory.mktemp("gemma3w"), "gemma3", sliding_window=24)


def test_a_windowed_model_routed_by_its_cache_equals_colocated(
    windowed_model: Path, request: pytest.FixtureRequest
) -> None:
    """Gemma 3's kind of model through the router (cache-aware, following KV events): a decode
    holds a prompt's early blocks without the windowed layer's KV (behind the window when they
    were sent); the router sends a prompt with the same 10 blocks there, which reuses them all
    (prefill computes the rest over its own cache, the windowed layer's blocks it reads being
    whole), and every text equals colocated."""
    shared = [3 + (19 * j) % 250 for j in range(160)]  # 10 blocks of 16 tokens
    prompts = [shared + [7, 8, 9], shared + [10, 11, 12, 13]]
    expected = reference(windowed_model, prompts, 8)
    c = Cluster(windowed_model, "cache_aware+kv_events")
    with logs_kept_on_failure(request, lambda: [p.log for p in c.procs]):
        try:
            holder = c.decodes[1]
            assert c.complete(prompts[0], 8, url=holder) == expected[0]
            deadline = time.monotonic() + 30
            while c.metric(c.router, "pdserve:router_kv_blocks", {"decode": holder}) < 10:
                assert time.monotonic() < deadline, "the router never saw the decode's KV events"
                time.sleep(0.1)
            before = c.metric(holder, "vllm:prefix_cache_hits_total")
            assert c.complete(prompts[1], 8) == expected[1]
            routed = "pdserve:router_requests_total"
            assert c.metric(c.router, routed, {"decode": holder}) == 1
            assert c.metric(holder, "vllm:prefix_cache_hits_total") - before == 160
        finally:
            c.stop()
