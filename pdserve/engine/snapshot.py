"""A node's state at one instant, as numbers: one typed field per gauge and per counter (a
counter maps its label's values to counts). Built on the engine thread (the only thread that
reads engine state) after every loop turn and rendered by both the gRPC `GetStats` and
Prometheus, so the two views never disagree. A field's metadata is its Prometheus help text
(and a counter's label name); a field left None is not reported by this kind of node (a
colocated node has no resource store) and is not exported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.scheduler import Scheduler

Counts = Mapping[str, float]  # label value -> count


def _gauge(help_text: str, always: bool = False) -> Any:
    return field(default=0 if always else None, metadata={"help": help_text})


def _counter(label: str, help_text: str) -> Any:
    return field(default=None, metadata={"help": help_text, "label": label})


@dataclass
class NodeSnapshot:
    # ---- gauges ----------------------------------------------------------------------------
    num_requests_running: float = _gauge("Number of requests in model execution batches", True)
    num_requests_waiting: float = _gauge("Number of requests waiting to be processed", True)
    num_requests_waiting_for_kv: float = _gauge(
        "Requests waiting for their KV from a prefill node", True
    )
    num_requests_waiting_peak: float | None = _gauge(
        "The most requests ever waiting to be scheduled at once"
    )
    held_for_send: float = _gauge("Finished requests whose blocks wait on a transfer", True)
    kv_blocks_used: float = _gauge("KV cache blocks in use", True)
    kv_blocks_free: float = _gauge("KV cache blocks free", True)
    kv_blocks_total: float = _gauge("KV cache blocks in all", True)
    kv_usage: float = _gauge(
        "Share of the KV cache's bytes requests hold (vllm:kv_cache_usage_perc)", True
    )
    kv_window_blocks_held: float | None = _gauge(
        "Sliding-window layers' parts of blocks that requests hold (the windows' blocks)"
    )
    kv_window_blocks_total: float | None = _gauge(
        "Sliding-window layers' parts of blocks that fit in the cache"
    )
    prefix_cache_hit_rate: float = _gauge(
        "Prompt tokens served from the prefix cache / prompt tokens", True
    )
    resource_store_entries: float | None = _gauge("Receive entries in the resource store")
    side_channel_entries: float | None = _gauge("Side-channel entries in the resource store")
    tombstones: float | None = _gauge("Cancelled keys remembered to reject late frames")
    pending_transfers: float | None = _gauge(
        "Transfers in flight (decode: prefill calls; prefill: sends)"
    )
    threads: float | None = _gauge("Threads alive in the node's process")
    # ---- counters --------------------------------------------------------------------------
    preemptions: Counts | None = _counter("kind", "Requests preempted by recompute")
    engine_steps: Counts | None = _counter("kind", "Forward passes the engine ran")
    prefix_cache_queries: Counts | None = _counter(
        "kind", "Prefix cache queries, in terms of number of queried tokens"
    )
    prefix_cache_hits: Counts | None = _counter(
        "kind", "Prefix cache hits, in terms of number of cached tokens"
    )
    requests_finished: Counts | None = _counter(
        "reason", "Requests the engine ended, by finish reason"
    )
    transfer_bytes: Counts | None = _counter("direction", "KV bytes transferred")
    transfer_failures: Counts | None = _counter("reason", "Transfers that failed, by reason")
    frames_rejected: Counts | None = _counter(
        "reason", "KV frames refused by the receiver, by reason"
    )
    canary_checks: Counts | None = _counter(
        "result", "Served requests recomputed by the canary and compared, by outcome"
    )
    kv_checksum_failures: Counts | None = _counter(
        "peer", "KV frames whose bytes failed their checksum (--kv-checksum), by prefill node"
    )
    not_split: Counts | None = _counter(
        "reason", "Requests served without disaggregation, by reason"
    )
    prefill_placement: Counts | None = _counter(
        "why",
        "Prompts --prefill-placement measured placed: remote_sooner, local_sooner, unmeasured "
        "(local), explore (remote, to learn it)",
    )
    migrations: Counts | None = _counter(
        "event",
        "Streams moved live between decode nodes: in (its KV fetched here), out (fetched from "
        "here), failed (its fetch failed: computed here)",
    )
    transfer_links: Counts | None = _counter(
        "event", "KV transfer connections (opened: reconnects included)"
    )
    transfer_connections: Counts | None = _counter(
        "event", "KV receiver connections closed or refused, by cause"
    )
    grpc_unauthenticated: Counts | None = _counter(
        "event", "gRPC calls refused for missing or bad credentials"
    )

    @staticmethod
    def total(counts: Counts | None) -> int:
        """A counter's sum over its labels (0 where not reported)."""
        return int(sum((counts or {}).values()))

    @staticmethod
    def count(counts: Counts | None, label: str) -> int:
        """A counter's value for one label (0 where not reported)."""
        return int((counts or {}).get(label, 0))


def reported(snap: NodeSnapshot) -> list[tuple[dataclasses.Field[Any], Any]]:
    """(field, value) of every gauge and counter this node reports, in declaration order."""
    return [
        (f, value) for f in dataclasses.fields(snap) if (value := getattr(snap, f.name)) is not None
    ]


def scheduler_snapshot(scheduler: Scheduler, pool: BlockPool) -> NodeSnapshot:
    """The engine's own gauges and counters: queues, blocks, prefix-cache hits, preemptions."""
    stats = scheduler.stats
    hit = stats.cached_prompt_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
    return NodeSnapshot(
        num_requests_running=len(scheduler.running),
        num_requests_waiting=len(scheduler.waiting),
        num_requests_waiting_for_kv=len(scheduler.waiting_for_kv),
        held_for_send=len(scheduler.held),
        kv_blocks_used=pool.num_used,
        kv_blocks_free=pool.num_free,
        kv_blocks_total=pool.num_blocks,
        kv_usage=pool.usage(),
        kv_window_blocks_held=pool.num_windows_held if pool.windowed else None,
        kv_window_blocks_total=pool.window_blocks,
        prefix_cache_hit_rate=hit,
        preemptions={"recompute": stats.num_preemptions},
        engine_steps={"forward": stats.num_steps},
        # as vLLM's: prompt tokens of admitted requests, and those found in the cache
        prefix_cache_queries={"tokens": stats.prompt_tokens},
        prefix_cache_hits={"tokens": stats.cached_prompt_tokens},
    )
