"""Every number a node's snapshot carries reaches Prometheus under its name, with its value,
and what a node does not report is left out."""

from __future__ import annotations

import dataclasses

from prometheus_client.parser import text_string_to_metric_families

from pdserve.api.metrics import ServingMetrics
from pdserve.engine.snapshot import NodeSnapshot


def scrape(snap: NodeSnapshot) -> dict[str, float]:
    metrics = ServingMetrics("m")
    metrics.collect_from(lambda: snap)
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def test_every_snapshot_field_is_exported_with_its_value() -> None:
    snap = NodeSnapshot()
    expected = {}
    for i, f in enumerate(dataclasses.fields(NodeSnapshot), start=1):
        if "label" in f.metadata:  # a counter: two label values
            setattr(snap, f.name, {"a": 10 * i, "b": 10 * i + 1})
            for key, value in (("a", 10 * i), ("b", 10 * i + 1)):
                expected[(f.name, f.metadata["label"], key)] = value
        else:
            setattr(snap, f.name, i)
            expected[(f.name, None, None)] = i
    got = scrape(snap)
    vllm = {"num_requests_running", "num_requests_waiting"}
    vllm_counters = {"prefix_cache_queries", "prefix_cache_hits"}
    for (name, label, key), value in expected.items():
        if name == "kv_usage":
            assert got["vllm:kv_cache_usage_perc{model_name=m}"] == value
        elif name in vllm:
            assert got[f"vllm:{name}{{model_name=m}}"] == value
        elif name in vllm_counters:  # vLLM's counters carry the model, not the label
            total = sum(v for (n, _, _), v in expected.items() if n == name)
            assert got[f"vllm:{name}_total{{model_name=m}}"] == total
        elif label is None:
            assert got[f"pdserve:{name}{{}}"] == value, name
        else:
            assert got[f"pdserve:{name}_total{{{label}={key}}}"] == value, name
    assert "pdserve:kv_usage{}" not in got  # exported under vLLM's name only


def test_what_a_node_does_not_report_is_not_exported() -> None:
    got = scrape(NodeSnapshot())  # a colocated node's: no resource store, no transfers
    assert "pdserve:kv_blocks_free{}" in got
    unreported = [f.name for f in dataclasses.fields(NodeSnapshot) if f.default is None]
    assert "resource_store_entries" in unreported and "transfer_bytes" in unreported
    for name in unreported:
        assert not any(
            k.startswith(f"pdserve:{name}{{") or k.startswith(f"pdserve:{name}_total") for k in got
        ), name
