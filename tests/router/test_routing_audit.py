"""The audit of the router's prefix predictions. End to end (a router following a decode's KV
events, real processes, tiny model, a KV cache of ~85 blocks): prompts sharing 12 long
prefixes are sent, sent again (hits), then a flood of other prompts evicts the prefixes and
they are sent a third time. Following the decode's KV events, the router learns the evictions
and predicts only what the decode holds: realized >= 95% of predicted. With the events cut
(the router holds the client key, not the router key /kv_events needs), it still predicts the
evicted prefixes: realized / predicted falls and the warning fires. And `RoutingAudit` alone:
its window, its cap on a surplus, its warning once per window."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.audit import AUDIT_MIN, RoutingAudit
from tests.disagg.cluster import free_port
from tests.helpers import logs_kept_on_failure, make_tiny_model
from tests.router.test_router_e2e import Proc

pytestmark = pytest.mark.slow

MODEL = "tiny"
BLOCK = 16
WARNING = "the router's prefix predictions are not realized"


def _metric(text: str, name: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


class AuditedFleet:
    """A router (following KV events: --tokenizer) in front of one colocated node whose KV
    cache holds ~85 blocks of the tiny model; `events` False: the router's key is the
    client's, so /kv_events (the router key's alone) refuses it."""

    def __init__(self, model: Path, tmp: Path, events: bool) -> None:
        self.procs: list[Proc] = []
        client_key, router_key = tmp / "client.key", tmp / "router.key"
        for path, key in ((client_key, "client-key-0123"), (router_key, "router-key-0123")):
            path.write_text(key)
            os.chmod(path, 0o600)
        self.decode = f"http://127.0.0.1:{free_port()}"
        self.router = f"http://127.0.0.1:{free_port()}"
        args = ["serve", "--role", "both", "--model", str(model), "--dtype", "float32"]
        args += ["--threads", "1", "--kv-cache-memory", "1", "--served-model-name", MODEL]
        args += ["--port", self.decode.rsplit(":", 1)[1], "--api-key-file", str(client_key)]
        args += ["--router-key-file", str(router_key)]
        self.procs.append(Proc(args, "decode"))
        self.procs[-1].wait_for("ready")
        router = ["router", "--decode", self.decode, "--port", self.router.rsplit(":", 1)[1]]
        router += ["--tokenizer", str(model), "--block-size", str(BLOCK)]
        router += ["--node-api-key-file", str(router_key if events else client_key)]
        self.procs.append(Proc(router, "router"))
        self.procs[-1].wait_for("router ready")
        self.http = httpx.Client(timeout=60, headers={"authorization": "Bearer client-key-0123"})

    def complete(self, prompt: list[int]) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        r = self.http.post(f"{self.router}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    def metric(self, name: str) -> float:
        return _metric(self.http.get(f"{self.router}/metrics").text, name)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.http.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def fleet(model: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[AuditedFleet]:
    procs: list[Proc] = []
    with logs_kept_on_failure(request, lambda: [p.log for p in procs]):
        f = AuditedFleet(model, tmp_path, request.param)
        procs.extend(f.procs)
        try:
            yield f
        finally:
            f.stop()


def _run_load(fleet: AuditedFleet) -> tuple[list[int], list[int]]:
    """The cached tokens the node found for the second and the third pass."""
    prefixes = [[3 + (11 * p + j) % 240 for j in range(4 * BLOCK)] for p in range(12)]

    def tail(k: int) -> list[int]:
        return [5 + (7 * k + j) % 240 for j in range(BLOCK)]

    for i, prefix in enumerate(prefixes):  # first pass: cached from now on
        fleet.complete(prefix + tail(i))
    second = [fleet.complete(prefix + tail(100 + i)) for i, prefix in enumerate(prefixes)]
    # 20 prompts of 80 tokens (descending runs: no prefix of the ascending ones above): with
    # their outputs over 100 blocks, so every prefix is evicted
    for k in range(20):
        fleet.complete([245 - (13 * k + j) % 230 for j in range(5 * BLOCK)])  # descending
    time.sleep(2.0)  # a few KV event polls (0.5 s apart)
    third = [fleet.complete(prefix + tail(200 + i)) for i, prefix in enumerate(prefixes)]
    return second, third


@pytest.mark.parametrize("fleet", [True], indirect=True)
def test_following_kv_events_the_predicted_hits_are_realized(fleet: AuditedFleet) -> None:
    second, third = _run_load(fleet)
    assert second == [4 * BLOCK] * 12  # the prefixes were there the second time
    assert third == [0] * 12  # and evicted by the third (the load does what it says)
    predicted = fleet.metric("pdserve:router_predicted_hit_tokens_total")
    realized = fleet.metric("pdserve:router_realized_hit_tokens_total")
    assert predicted >= 12 * 4 * BLOCK  # the second pass was predicted
    assert realized >= 0.95 * predicted, (realized, predicted)
    assert WARNING not in fleet.procs[-1].log.read_text()


@pytest.mark.parametrize("fleet", [False], indirect=True)
def test_with_kv_events_cut_the_audit_falls_and_warns(fleet: AuditedFleet) -> None:
    second, third = _run_load(fleet)
    assert second == [4 * BLOCK] * 12 and third == [0] * 12
    predicted = fleet.metric("pdserve:router_predicted_hit_tokens_total")
    realized = fleet.metric("pdserve:router_realized_hit_tokens_total")
    assert predicted == 24 * 4 * BLOCK  # the evicted prefixes predicted too: blind
    assert realized == 12 * 4 * BLOCK
    assert fleet.metric("pdserve:router_hit_realization") == pytest.approx(0.5)
    assert WARNING in fleet.procs[-1].log.read_text()


def test_the_audit_caps_a_surplus_and_warns_once_per_window(
    caplog: pytest.LogCaptureFixture,
) -> None:
    audit = RoutingAudit(CollectorRegistry(), window=32, threshold=0.8)
    read = audit.expect("d", 32)
    read(b'data: {"choices": [], "pdserve_cached_tokens": 48}\n\n')  # more than predicted
    read(b'data: {"pdserve_cached_tokens": 0}\n\n')  # settled already: ignored
    assert audit.window[-1] == (32, 32)
    audit.expect("d", 0)(b'{"pdserve_cached_tokens": 16}')  # nothing predicted: not audited
    assert len(audit.window) == 1
    with caplog.at_level(logging.WARNING, logger="pdserve.router.audit"):
        for _ in range(AUDIT_MIN - 2):
            audit.settle("d", 32, 0)
        assert not caplog.records  # fewer than AUDIT_MIN predictions: not judged yet
        audit.settle("d", 32, 0)
        assert len(caplog.records) == 1 and WARNING in caplog.text
        for _ in range(AUDIT_MIN - 1):
            audit.settle("d", 32, 0)
        assert len(caplog.records) == 1  # once per window's worth
        for _ in range(32):
            audit.settle("d", 32, 32)
    assert audit.share._value.get() == 1.0  # the window moved on: all realized again
