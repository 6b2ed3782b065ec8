"""Prometheus metrics. Where the concept is vLLM's, the name and labels are vLLM's (`vllm:*`
with `model_name`: requests running and waiting, KV-cache usage, prefix-cache queries and
hits, TTFT / inter-token / end-to-end latency, finished requests, prompt and generation
tokens), so dashboards and routers built for vLLM read them unchanged; the rest, and
everything about disaggregation, is `pdserve:*`. Latencies are observed by the API as outputs
arrive; node state (blocks, queues, store sizes, transfer counters) is read at scrape time
from the node's snapshot, so no thread polls for it. The transfer latency histograms are
observed by the node itself (`on_handoff`, `on_frame`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.disagg.wire import TransferStats
from pdserve.engine.snapshot import NodeSnapshot, reported

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60)

# Snapshot fields exported under vLLM's names (with its `model_name` label); the rest are
# `pdserve:<field>`, their help text and label from the snapshot's field metadata.
VLLM_GAUGES = ("num_requests_running", "num_requests_waiting")
VLLM_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits")
VLLM_NAMED = ("kv_usage",)  # vllm:kv_cache_usage_perc


class _NodeCollector(Collector):
    def __init__(self, snapshot: Callable[[], NodeSnapshot], model_name: str) -> None:
        self.snapshot = snapshot
        self.model_name = model_name

    def _vllm(self, snap: NodeSnapshot) -> Iterator[Metric]:
        labels, values = ["model_name"], [self.model_name]
        helps = {f.name: f.metadata["help"] for f in dataclasses.fields(snap)}
        for name in VLLM_GAUGES:
            family = GaugeMetricFamily(f"vllm:{name}", helps[name], labels=labels)
            family.add_metric(values, getattr(snap, name))
            yield family
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=labels
        )
        usage.add_metric(values, snap.kv_usage)
        yield usage
        for name in VLLM_COUNTERS:
            counter = CounterMetricFamily(f"vllm:{name}", helps[name], labels=labels)
            counter.add_metric(values, NodeSnapshot.total(getattr(snap, name)))
            yield counter

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        yield from self._vllm(snap)
        for f, value in reported(snap):
            if f.name in VLLM_GAUGES or f.name in VLLM_COUNTERS or f.name in VLLM_NAMED:
                continue
            text = f.metadata["help"]
            if "label" not in f.metadata:
                yield GaugeMetricFamily(f"pdserve:{f.name}", text, value=value)
                continue
            family = CounterMetricFamily(f"pdserve:{f.name}", text, labels=[f.metadata["label"]])
            for key, count in value.items():
                family.add_metric([key], count)
            yield family


class ServingMetrics:
    """Built before the node (which observes transfer latencies into it); `collect_from`
    then names the node whose snapshot each scrape renders."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry
        by_model = ["model_name"]

        def latency(name: str, text: str) -> Histogram:
            return Histogram(f"vllm:{name}", text, by_model, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = latency("time_to_first_token_seconds", "Time to first token").labels(model_name)
        self.itl = latency("inter_token_latency_seconds", "Inter-token latency").labels(model_name)
        self.e2e = latency("e2e_request_latency_seconds", "End-to-end request latency").labels(
            model_name
        )
        self._finished = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed", by_model, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens produced", by_model, registry=r
        ).labels(model_name)
        self.ttft_stage = Histogram(
            "pdserve:ttft_breakdown_seconds",
            "Time to first token by stage (queueing, prefill compute, exposed transfer, ...)",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_request = Histogram(
            "pdserve:transfer_latency_seconds",
            "From starting a remote prefill to its KV and first token being claimed",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_layer = Histogram(
            "pdserve:transfer_layer_latency_seconds",
            "Receiving one layer's frame",
            buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5),
            registry=r,
        )

        # Per request, as the prefill node reports its transfer (decode observes them).
        def histogram(
            name: str, text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS
        ) -> Histogram:
            return Histogram(f"pdserve:{name}", text, buckets=buckets, registry=r)

        self.kv_request_bytes = histogram(
            "kv_transfer_request_bytes",
            "KV bytes a remote prefill sent for one request",
            tuple(2**k for k in range(12, 34, 2)),  # 4 KiB .. 8 GiB
        )
        self.transfer_seconds = histogram(
            "kv_transfer_request_seconds",
            "One request's KV transfer, from its prompt's first step to its last layer sent",
        )
        self.transfer_rate = histogram(
            "kv_transfer_request_gb_per_second",
            "One request's KV bytes over its transfer's duration (GB/s)",
            (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
        )
        self.transfer_exposed = histogram(
            "kv_transfer_exposed_seconds",
            "Of one request's KV transfer, the time after its last layer was computed",
        )
        self.transfer_prefill_wait = histogram(
            "kv_transfer_prefill_wait_seconds",
            "A remote prefill's wait on the prefill node before its prompt's first step",
        )

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def collect_from(self, snapshot: Callable[[], NodeSnapshot]) -> None:
        self.registry.register(_NodeCollector(snapshot, self.model_name))

    def on_handoff(self, seconds: float) -> None:
        self.transfer_request.observe(seconds)

    def on_transfer(self, stats: TransferStats) -> None:
        """One remote prefill's KV transfer, as its prefill node reported it."""
        self.kv_request_bytes.observe(stats.bytes)
        self.transfer_seconds.observe(stats.seconds)
        if stats.seconds > 0:
            self.transfer_rate.observe(stats.bytes / stats.seconds / 1e9)
        self.transfer_exposed.observe(stats.exposed_s)
        self.transfer_prefill_wait.observe(stats.prefill_wait_s)

    def on_frame(self, seconds: float) -> None:
        self.transfer_layer.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
