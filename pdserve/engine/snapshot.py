"""A node's state at one instant, as numbers: gauges by name and counters by name and label.
Built on the engine thread (the only thread that reads engine state) after every loop turn and
rendered by both the gRPC `GetStats` and Prometheus, so the two views never disagree."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


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
