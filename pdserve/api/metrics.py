"""Prometheus metrics in the style of vLLM's `vllm:*`, prefixed `pdserve:`. Latencies are
observed by the API as outputs arrive; node state (blocks, queues, store sizes, transfer
counters) is read at scrape time from the node's snapshot, so no thread polls for it. The
transfer latency histograms are observed by the node itself (`on_handoff`, `on_frame`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.snapshot import NodeSnapshot

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60)

GAUGE_HELP = {
    "num_requests_running": "Requests in the decode batch",
    "num_requests_waiting": "Requests waiting to be scheduled",
    "num_requests_waiting_peak": "The most requests ever waiting to be scheduled at once",
    "num_requests_waiting_for_kv": "Requests waiting for their KV from a prefill node",
    "kv_blocks_used": "KV cache blocks in use",
    "kv_blocks_free": "KV cache blocks free",
    "kv_blocks_total": "KV cache blocks in all",
    "prefix_cache_hit_rate": "Prompt tokens served from the prefix cache / prompt tokens",
    "resource_store_entries": "Receive entries in the resource store",
    "side_channel_entries": "Side-channel entries in the resource store",
    "tombstones": "Cancelled keys remembered to reject late frames",
    "pending_transfers": "Transfers in flight (decode: prefill calls; prefill: sends)",
    "held_for_send": "Finished requests whose blocks wait on a transfer",
    "threads": "Threads alive in the node's process",
}
COUNTER_HELP = {
    "transfer_bytes": ("direction", "KV bytes transferred"),
    "transfer_failures": ("reason", "Transfers that failed, by reason"),
    "frames_rejected": ("reason", "KV frames refused by the receiver, by reason"),
    "not_split": ("reason", "Requests served without disaggregation, by reason"),
    "preemptions": ("kind", "Requests preempted by recompute"),
    "engine_steps": ("kind", "Forward passes the engine ran"),
    "prefix_cache_queries": ("unit", "Prompt tokens of admitted requests (prefix cache lookups)"),
    "prefix_cache_hits": ("unit", "Prompt tokens found in the prefix cache"),
    "transfer_links": ("event", "KV transfer connections (opened: reconnects included)"),
    "requests_finished": ("reason", "Requests the engine ended, by finish reason"),
    "transfer_connections": ("event", "KV receiver connections closed or refused, by cause"),
    "grpc_unauthenticated": ("event", "gRPC calls refused for missing or bad credentials"),
}


class _NodeCollector(Collector):
    def __init__(self, snapshot: Callable[[], NodeSnapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        for name, value in snap.gauges.items():
            yield GaugeMetricFamily(f"pdserve:{name}", GAUGE_HELP.get(name, name), value=value)
        for name, values in snap.counters.items():
            label, text = COUNTER_HELP.get(name, ("kind", name))
            family = CounterMetricFamily(f"pdserve:{name}", text, labels=[label])
            for key, value in values.items():
                family.add_metric([key], value)
            yield family


class ServingMetrics:
    """Built before the node (which observes transfer latencies into it); `collect_from`
    then names the node whose snapshot each scrape renders."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve:requests", "Finished requests by outcome", ["outcome"], registry=r
        )
        self.ttft = Histogram(
            "pdserve:time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve:inter_token_latency_seconds",
            "Gap between streamed tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve:e2e_request_latency_seconds",
            "Request latency",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
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

    def collect_from(self, snapshot: Callable[[], NodeSnapshot]) -> None:
        self.registry.register(_NodeCollector(snapshot))

    def on_handoff(self, seconds: float) -> None:
        self.transfer_request.observe(seconds)

    def on_frame(self, seconds: float) -> None:
        self.transfer_layer.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
