"""Prometheus metrics. Where the concept is vLLM's, the name and labels are vLLM's (`vllm:*`
with `model_name`: requests running and waiting, KV-cache usage, prefix-cache queries and
hits, TTFT / inter-token / end-to-end latency, finished requests, prompt and generation
tokens), so dashboards and routers built for vLLM read them unchanged; the rest, and
everything about disaggregation, is `pdserve:*`. Latencies are observed by the API as outputs
arrive; node state (blocks, queues, store sizes, transfer counters) is read at scrape time
from the node's snapshot, so no thread polls for it. The transfer latency histograms are
observed by the node itself (`on_handoff`, `on_frame`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.snapshot import NodeSnapshot

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60)

GAUGE_HELP = {
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
    "transfer_links": ("event", "KV transfer connections (opened: reconnects included)"),
    "requests_finished": ("reason", "Requests the engine ended, by finish reason"),
    "transfer_connections": ("event", "KV receiver connections closed or refused, by cause"),
    "grpc_unauthenticated": ("event", "gRPC calls refused for missing or bad credentials"),
}


# Snapshot gauges and counters exported under vLLM's names (with its `model_name` label).
VLLM_GAUGES = {
    "num_requests_running": "Number of requests in model execution batches",
    "num_requests_waiting": "Number of requests waiting to be processed",
}
VLLM_COUNTERS = {
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens",
}


class _NodeCollector(Collector):
    def __init__(self, snapshot: Callable[[], NodeSnapshot], model_name: str) -> None:
        self.snapshot = snapshot
        self.model_name = model_name

    def _vllm(self, snap: NodeSnapshot) -> Iterator[Metric]:
        labels, values = ["model_name"], [self.model_name]
        for name, text in VLLM_GAUGES.items():
            family = GaugeMetricFamily(f"vllm:{name}", text, labels=labels)
            family.add_metric(values, snap.gauges.get(name, 0))
            yield family
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=labels
        )
        total = snap.gauges.get("kv_blocks_total", 0)
        usage.add_metric(values, snap.gauges.get("kv_blocks_used", 0) / total if total else 0.0)
        yield usage
        for name, text in VLLM_COUNTERS.items():
            counter = CounterMetricFamily(f"vllm:{name}", text, labels=labels)
            counter.add_metric(values, snap.total(name))
            yield counter

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        yield from self._vllm(snap)
        for name, value in snap.gauges.items():
            if name in VLLM_GAUGES:
                continue
            yield GaugeMetricFamily(f"pdserve:{name}", GAUGE_HELP.get(name, name), value=value)
        for name, values in snap.counters.items():
            if name in VLLM_COUNTERS:
                continue
            label, text = COUNTER_HELP.get(name, ("kind", name))
            family = CounterMetricFamily(f"pdserve:{name}", text, labels=[label])
            for key, value in values.items():
                family.add_metric([key], value)
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

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def collect_from(self, snapshot: Callable[[], NodeSnapshot]) -> None:
        self.registry.register(_NodeCollector(snapshot, self.model_name))

    def on_handoff(self, seconds: float) -> None:
        self.transfer_request.observe(seconds)

    def on_frame(self, seconds: float) -> None:
        self.transfer_layer.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
