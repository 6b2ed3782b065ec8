"""OpenTelemetry traces across the fleet: a router, a decode and a prefill node (real processes on
loopback, tiny random model) export to a collector this test runs (OTLP/HTTP, decoded with
OpenTelemetry's own protobuf messages). One request sent with a client's `traceparent` makes one
trace whose spans come from all three processes, each parented on the one that called it, and
whose KV transfer span (and decode's per-request transfer histograms) count exactly the bytes of
the prompt's KV as the model's shape gives them. With no endpoint configured, no exporter thread
runs (and one does when it is)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.otlp import SpanReceiver
from pdserve.cli.configs import traces_endpoint
from pdserve.cli.flags import build_parser
from pdserve.tracing import traces_url
from tests.disagg.cluster import free_port
from tests.helpers import logs_kept_on_failure, make_tiny_model
from tests.router.test_router_e2e import Proc, start_pd_fleet

MODEL = "tiny"
BLOCK = 16


class Collector(SpanReceiver):
    """The receiver, and the one span of a name in a trace."""

    def named(self, name: str, trace_id: str) -> dict[str, Any]:
        found = [s for s in self.trace(trace_id) if s["name"] == name]
        assert len(found) == 1, (name, [s["name"] for s in self.spans])
        return found[0]


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    try:
        yield c
    finally:
        c.close()


def test_one_request_is_one_trace_across_router_decode_and_prefill(
    tmp_path: Path, collector: Collector, request: pytest.FixtureRequest
) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "100"}  # export within 0.1 s
    procs: list[Proc] = []
    with logs_kept_on_failure(request, lambda: [p.log for p in procs]):
        try:
            flags = ("--otlp-traces-endpoint", collector.url)
            router, decode, prefill = start_pd_fleet(procs, model, flags, env)
            client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
            prompt = [3 + (5 * j) % 200 for j in range(40)]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0}
            r = httpx.post(
                f"{router}/v1/completions",
                json={**body, "ignore_eos": True},
                headers={"traceparent": f"00-{client_trace}-{client_span}-01"},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            expected = {
                "pdserve.router.request",
                "pdserve.decode.request",
                "pdserve.decode.prefill_call",
                "pdserve.prefill.request",
                "pdserve.kv.transfer",
                "pdserve.decode.generate",
            }
            decode_metrics = httpx.get(f"{decode}/metrics", timeout=10).text
            deadline = time.monotonic() + 30
            while not expected <= {s["name"] for s in collector.trace(client_trace)}:
                assert time.monotonic() < deadline, [s["name"] for s in collector.spans]
                time.sleep(0.1)
        finally:
            for p in reversed(procs):
                p.stop()

    spans = collector.trace(client_trace)
    assert {s["trace_id"] for s in collector.spans} == {client_trace}  # one trace: the client's
    assert {s["service"] for s in spans} == {"pdserve-router", "pdserve-decode", "pdserve-prefill"}
    by_id = {s["span_id"]: s for s in spans}
    for s in spans:  # every parent is in the trace (the root's: the client's span)
        assert s["parent"] in by_id or s["parent"] == client_span, s

    def parent(name: str) -> str:
        p = collector.named(name, client_trace)["parent"]
        return p if p == client_span else str(by_id[p]["name"])

    assert collector.named("pdserve.router.request", client_trace)["parent"] == client_span
    assert parent("pdserve.decode.request") == "pdserve.router.request"
    assert parent("pdserve.decode.prefill_call") == "pdserve.decode.request"
    assert parent("pdserve.prefill.request") == "pdserve.decode.prefill_call"
    for stage in ("pdserve.prefill.queue", "pdserve.prefill.compute", "pdserve.kv.transfer"):
        assert parent(stage) == "pdserve.prefill.request"
        assert collector.named(stage, client_trace)["service"] == "pdserve-prefill"
    for stage in ("pdserve.decode.queue", "pdserve.decode.admission", "pdserve.decode.generate"):
        assert parent(stage) == "pdserve.decode.request"
        assert collector.named(stage, client_trace)["service"] == "pdserve-decode"

    routed = collector.named("pdserve.router.request", client_trace)["attributes"]
    assert routed["pdserve.router.decode"] == decode
    assert routed["pdserve.router.prefill"] == prefill
    assert routed["pdserve.router.policy"] == "cache_aware"
    assert (
        collector.named("pdserve.decode.generate", client_trace)["attributes"]["pdserve.tokens"]
        == 5
    )
    # The prompt's KV as the model's shape makes it: every block, every layer, K and V.
    config = json.loads((model / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_block = 2 * config["num_key_value_heads"] * BLOCK * head_dim * 4  # float32
    kv_bytes = math.ceil(len(prompt) / BLOCK) * config["num_hidden_layers"] * per_block
    transfer = collector.named("pdserve.kv.transfer", client_trace)["attributes"]
    assert transfer["pdserve.kv.bytes"] == kv_bytes
    assert transfer["pdserve.kv.blocks"] == math.ceil(len(prompt) / BLOCK)
    assert transfer["pdserve.kv.gb_per_s"] > 0
    assert all(s["status"] != 2 for s in spans)  # STATUS_CODE_ERROR: nothing failed
    # The same transfer in decode's per-request histograms.
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(decode_metrics)
        for s in family.samples
        if s.name.startswith("pdserve:kv_transfer_")
    }
    assert samples["pdserve:kv_transfer_request_bytes_count"] == 1
    assert samples["pdserve:kv_transfer_request_bytes_sum"] == kv_bytes
    assert samples["pdserve:kv_transfer_request_gb_per_second_count"] == 1
    assert samples["pdserve:kv_transfer_exposed_seconds_count"] == 1


PROBE = """
import sys, threading
from pdserve import tracing
from pdserve.cli.configs import traces_endpoint
from pdserve.cli.flags import build_parser
noop = lambda a: 0
args = build_parser(noop, noop, noop).parse_args(["router", "--decode", "http://127.0.0.1:1"])
tracing.setup("pdserve-router", traces_endpoint(args))
tracing.start("pdserve.router.request").end()
threads = [t.name for t in threading.enumerate() if t.name != "MainThread"]
print(" ".join(threads) or "-", "sdk" if "opentelemetry.sdk" in sys.modules else "nosdk")
"""


def _probe(**extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**env, **extra}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_with_tracing_off_no_exporter_thread_runs() -> None:
    assert _probe() == "- nosdk"  # not even the SDK is imported
    # The control: the same process with an endpoint starts the SDK's batch exporter thread.
    on = _probe(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    assert "OtelBatchSpan" in on and on.endswith(" sdk"), on


def test_the_endpoint_comes_from_the_flag_then_opentelemetrys_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    parser = build_parser(lambda a: 0, lambda a: 0, lambda a: 0)
    parse = lambda *a: parser.parse_args(["router", "--decode", "http://d", *a])  # noqa: E731
    assert traces_endpoint(parse()) is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318/")
    assert traces_endpoint(parse()) == "http://c:4318/v1/traces"  # the signal's path added
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://t:9/x")
    assert traces_endpoint(parse()) == "http://t:9/x"  # the traces endpoint as it is
    assert traces_endpoint(parse("--otlp-traces-endpoint", "f:1")) == "f:1"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert traces_endpoint(parse()) is None
    assert traces_endpoint(parse("--otlp-traces-endpoint", "f:1")) == "f:1"  # asked for
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert traces_endpoint(parse("--otlp-traces-endpoint", "f:1")) is None
    assert traces_url("f:1") == "http://f:1/v1/traces"
    assert traces_url("https://c:4318") == "https://c:4318/v1/traces"
    assert traces_url("http://c:4318/custom") == "http://c:4318/custom"
