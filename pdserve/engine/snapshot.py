"""A node's state at one instant, as numbers: gauges by name and counters by name and label.
Built on the engine thread (the only thread that reads engine state) after every loop turn and
rendered by both the gRPC `GetStats` and Prometheus, so the two views never disagree."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.scheduler import Scheduler


@dataclass
class NodeSnapshot:
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, Mapping[str, float]] = field(default_factory=dict)  # name -> label -> value

    def gauge(self, name: str) -> int:
        return int(self.gauges.get(name, 0))

    def total(self, counter: str) -> int:
        return int(sum(self.counters.get(counter, {}).values()))

    def count(self, counter: str, label: str) -> int:
        return int(self.counters.get(counter, {}).get(label, 0))


def scheduler_snapshot(scheduler: Scheduler, pool: BlockPool) -> NodeSnapshot:
    """The engine's own gauges and counters: queues, blocks, prefix-cache hits, preemptions."""
    stats = scheduler.stats
    hit = stats.cached_prompt_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
    return NodeSnapshot(
        gauges={
            "num_requests_running": len(scheduler.running),
            "num_requests_waiting": len(scheduler.waiting),
            "num_requests_waiting_for_kv": len(scheduler.waiting_for_kv),
            "held_for_send": len(scheduler.held),
            "kv_blocks_used": pool.num_used,
            "kv_blocks_free": pool.num_free,
            "kv_blocks_total": pool.num_blocks,
            "prefix_cache_hit_rate": hit,
        },
        counters={
            "preemptions": {"recompute": stats.num_preemptions},
            "engine_steps": {"forward": stats.num_steps},
            # as vLLM's: prompt tokens of admitted requests, and those found in the cache
            "prefix_cache_queries": {"tokens": stats.prompt_tokens},
            "prefix_cache_hits": {"tokens": stats.cached_prompt_tokens},
        },
    )
