"""KV events: which prefix-cache blocks a node holds, as a stream of changes others can follow
(a router's prefix index). The block pool reports each cache key it registers (`stored`) and
each one it evicts (`removed`); readers on other threads ask for the changes after the last
sequence number they saw (`since`) and get them, or, when they come from another epoch (the
node restarted) or fell further behind than the log keeps, every key held now (`reset`).
Keys are the engine's chained block cache keys (`block_pool.cache_keys`): equal prefixes
have equal keys on every node."""

from __future__ import annotations

import threading
import uuid
from collections import deque
from dataclasses import dataclass, field

MAX_EVENTS = 65536


@dataclass(frozen=True)
class KVChanges:
    epoch: str
    seq: int  # the last change included: the next `since`
    reset: bool  # True: `stored` is every key held now; forget anything known before
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


class KVEventLog:
    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        self.epoch = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._seq = 0
        self._events: deque[tuple[int, bool, int]] = deque(maxlen=max_events)  # seq, stored, key
        self._held: set[int] = set()

    def stored(self, key: int) -> None:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, True, key))
            self._held.add(key)

    def removed(self, key: int) -> None:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, False, key))
            self._held.discard(key)

    def since(self, seq: int, epoch: str | None = None) -> KVChanges:
        """The changes after `seq`; the lock (which the engine thread takes for every block it
        stores or evicts) is held only to copy: sorting a full picture happens outside it."""
        with self._lock:
            oldest = self._events[0][0] if self._events else self._seq + 1
            now = self._seq
            if epoch != self.epoch or seq > now or seq < oldest - 1:
                held = list(self._held)
                changes = None
            else:
                changes = [(is_stored, key) for s, is_stored, key in self._events if s > seq]
        if changes is None:
            return KVChanges(self.epoch, now, True, sorted(held))
        stored = [key for is_stored, key in changes if is_stored]
        removed = [key for is_stored, key in changes if not is_stored]
        return KVChanges(self.epoch, now, False, stored, removed)
