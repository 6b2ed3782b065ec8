"""Layer-ready events: the model runner records one after each layer wrote its KV, and the KV
sender waits on it before reading that layer's blocks. On CPU the write has happened when the
callback runs, so the event is complete at once (a GPU backend records a device event here).
Tests use a controllable event (`ManualEvent` in tests/disagg/kvfixtures.py)."""

from __future__ import annotations

from typing import Protocol


class AsyncEvent(Protocol):
    def ready(self) -> bool:
        """True once the work recorded before the event has finished. Never blocks."""
        ...

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds; True if the event completed."""
        ...


class CompletedEvent:
    """CPU: ops are synchronous, so the layer's KV is in memory when the event is made."""

    def ready(self) -> bool:
        return True

    def wait(self, timeout: float) -> bool:
        return True
