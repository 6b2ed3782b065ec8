"""Decode-side bookkeeping of KV handoffs, keyed by unique key. Thread-safe: receiver threads
write frames, the event loop delivers side-channel data, the engine thread claims.

Lifecycle of an entry: `register` (target blocks, expected sizes, absolute deadline) -> frames
arrive layer by layer (`begin_frame` / `end_frame`) -> complete when every layer arrived and the
side channel holds the first token -> exactly one `claim` takes it. `fail` records an error
(the claimer gets it, at once, even while a frame is still being written); `cancel` removes the
entry and leaves a tombstone so late frames are refused; `sweep` expires entries, side-channel
data and tombstones past their deadlines. Nothing here waits for a writer: an entry cancelled
or claimed while a frame writes into its blocks is *draining*, and its key is `pop_released`
once the last writer is out (the owner holds the blocks until then).
A failure is a typed `Failure` (reason, stage, message) from the moment it is recorded.
Side-channel data (first token, its logprob, reuse lengths) lives in its own map with its own
deadline, so it is kept whether it arrives before or after the KV.

Every wait is on a condition with an absolute deadline; nothing sleeps in a loop.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable

from pdserve.disagg.receive_entry import (
    ClaimResult,
    EntryProgress,
    KVLoadError,
    ReceiveEntry,
    SideChannelSlot,
    StoreStats,
    TransferStage,
)
from pdserve.disagg.transport.base import FrameRefused, FrameRejected
from pdserve.disagg.wire import SideChannelData
from pdserve.engine.failure import Failure, FailureReason

TOMBSTONE_TTL_S = 60.0


class ResourceStore:
    def __init__(self, on_ready: Callable[[str], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._entries: dict[str, ReceiveEntry] = {}
        self._side: dict[str, SideChannelSlot] = {}
        self._tombstones: dict[str, float] = {}  # key -> when to forget it
        self._ready: deque[str] = deque()  # complete or failed, not yet claimed
        self._draining: dict[str, ReceiveEntry] = {}  # taken, a frame still writing
        self._released: deque[str] = deque()  # draining keys whose last writer is out
        self._on_ready = on_ready
        self.frames_rejected: dict[str, int] = {}
        self.bytes_received = 0

    # ---- registration -------------------------------------------------------------------

    def register(
        self,
        unique_key: str,
        request_id: str,
        block_ids: list[int],
        num_blocks_expected: int,
        num_layers: int,
        block_bytes: int,
        deadline: float,
        num_kv_heads: int = 1,
    ) -> None:
        """`block_bytes`: a block's K and V of all `num_kv_heads` heads in one layer."""
        with self._lock:
            if unique_key in self._entries or unique_key in self._tombstones:
                raise ValueError(f"unique key {unique_key} is already in use")
            self._entries[unique_key] = ReceiveEntry(
                unique_key,
                request_id,
                frozenset(block_ids),
                num_blocks_expected,
                num_layers,
                block_bytes,
                deadline,
                num_kv_heads=num_kv_heads,
            )
            if num_blocks_expected == 0:  # everything was cached on decode
                self._mark_done(self._entries[unique_key])

    # ---- frames (receiver threads) ----------------------------------------------------

    def _bound_entry_locked(self, unique_key: str, link: int) -> ReceiveEntry:
        """The live entry of a frame that came on `link`, binding it to that connection on
        its first frame; raises FrameRefused for a dead key or another connection's key."""
        entry = self._entries.get(unique_key)
        if entry is None:
            reason = "cancelled_key" if unique_key in self._tombstones else "unknown_key"
            message = f"frame for {reason.replace('_', ' ')} {unique_key}"
            raise self._reject_locked(reason, message, refused=True)
        if entry.link is None:
            entry.link = link
        elif entry.link != link:
            message = f"frame for unique key {unique_key} on a connection it is not bound to"
            raise self._reject_locked("foreign_link", message, refused=True)
        return entry

    def begin_frame(
        self,
        unique_key: str,
        layer: int,
        block_ids: list[int],
        block_bytes: int,
        link: int = 0,
        head_count: int = 0,
    ) -> ReceiveEntry:
        """Validate a frame header (of `head_count` KV heads, 0: all) before any byte is
        written; raises FrameRejected."""
        with self._lock:
            entry = self._bound_entry_locked(unique_key, link)
            if entry.stage == TransferStage.FAILED:
                message = f"unique key {unique_key}: entry already failed ({entry.failure})"
                raise self._reject_locked("failed_key", message, refused=True)
            problem = entry.frame_problem(layer, block_ids, block_bytes, head_count)
            if problem is not None:
                reason, message = problem
                failure = Failure(FailureReason.TRANSFER_FAILED, f"rejected a frame: {message}")
                self._fail_locked(entry, failure)
                raise self._reject_locked(reason, f"unique key {unique_key}: {message}")
            entry.writing += 1
            entry.stage = max(entry.stage, TransferStage.TRANSFERRING)
            return entry

    def end_frame(
        self, entry: ReceiveEntry, layer: int, num_blocks: int, ok: bool, head_count: int = 0
    ) -> None:
        with self._lock:
            entry.writing -= 1
            if self._draining.get(entry.unique_key) is entry:
                if entry.writing == 0:
                    del self._draining[entry.unique_key]
                    self._released.append(entry.unique_key)
                    if self._on_ready is not None:
                        self._on_ready(entry.unique_key)
                return
            if ok:
                heads = head_count or entry.num_kv_heads
                nbytes = num_blocks * heads * entry.block_bytes // entry.num_kv_heads
                entry.bytes_received += nbytes
                self.bytes_received += nbytes
                got = entry.heads_per_layer.get(layer, 0) + num_blocks * heads
                entry.heads_per_layer[layer] = got
                if got == entry.num_blocks_expected * entry.num_kv_heads:
                    entry.layers_done.add(layer)
                if len(entry.layers_done) == entry.num_layers:
                    self._mark_done(entry)
            else:
                message = f"connection lost while receiving layer {layer}"
                self._fail_locked(entry, Failure(FailureReason.TRANSFER_FAILED, message))
            if entry.writing == 0 and entry.stage == TransferStage.FAILED:
                self._push_ready(entry.unique_key)  # claimable now that no frame writes
            self._changed.notify_all()

    def progress(self, unique_key: str) -> EntryProgress | None:
        with self._lock:
            entry = self._entries.get(unique_key)
            if entry is None:
                return None
            return EntryProgress(entry.stage, frozenset(entry.layers_done), entry.writing)

    # ---- side channel ------------------------------------------------------------------

    def put_side_channel(self, unique_key: str, data: SideChannelData, deadline: float) -> bool:
        """Store the first token etc.; dropped (False) if past its deadline or cancelled."""
        with self._lock:
            if time.time() >= deadline or unique_key in self._tombstones:
                return False
            self._side[unique_key] = SideChannelSlot(data, deadline)
            entry = self._entries.get(unique_key)
            if entry is not None and entry.stage == TransferStage.DONE:
                self._push_ready(unique_key)
            self._changed.notify_all()
            return True

    # ---- completion, failure, claim -----------------------------------------------------

    def _mark_done(self, entry: ReceiveEntry) -> None:
        entry.stage = TransferStage.DONE
        entry.done_at = time.time()
        if entry.unique_key in self._side:
            self._push_ready(entry.unique_key)

    def _push_ready(self, unique_key: str) -> None:
        self._ready.append(unique_key)
        if self._on_ready is not None:
            self._on_ready(unique_key)

    def untouched(self, unique_key: str) -> bool:
        """The entry is live and no frame has reached it (another prefill node may send it)."""
        with self._lock:
            entry = self._entries.get(unique_key)
            return entry is not None and entry.link is None and entry.failure is None

    def set_peer(self, unique_key: str, peer: str) -> None:
        """Name the prefill node sending this entry (its failures will name it)."""
        with self._lock:
            entry = self._entries.get(unique_key)
            if entry is not None:
                entry.peer = peer

    def fail(self, unique_key: str, failure: Failure) -> None:
        """Fail the entry (the first failure wins); a failure without a stage gets the
        entry's."""
        with self._lock:
            entry = self._entries.get(unique_key)
            if entry is not None:
                self._fail_locked(entry, failure)
                self._changed.notify_all()

    def fail_from(self, unique_key: str, failure: Failure, link: int) -> None:
        """A FAILURE frame that came on `link`: fails the entry only if its frames are bound
        to that connection (or it has none yet); raises FrameRefused otherwise."""
        with self._lock:
            entry = self._bound_entry_locked(unique_key, link)
            self._fail_locked(entry, failure)
            self._changed.notify_all()

    def _fail_locked(self, entry: ReceiveEntry, failure: Failure) -> None:
        if entry.stage == TransferStage.FAILED:
            return
        if not failure.stage:
            failure = dataclasses.replace(failure, stage=entry.stage.name.lower())
        if not failure.peer:
            failure = dataclasses.replace(failure, peer=entry.peer)
        entry.failure = failure
        entry.stage = TransferStage.FAILED
        self._push_ready(entry.unique_key)

    def violation(self, unique_key: str, reason: str, message: str, link: int = 0) -> FrameRejected:
        """Count a protocol violation (any thread), fail the entry it names if live and not
        bound to another connection, and make the error that closes that connection."""
        with self._lock:
            entry = self._entries.get(unique_key)
            if entry is not None and entry.link in (None, link):
                failure = Failure(FailureReason.TRANSFER_FAILED, f"rejected a frame: {message}")
                self._fail_locked(entry, failure)
                self._changed.notify_all()
            return self._reject_locked(reason, message)

    def _reject_locked(self, reason: str, message: str, refused: bool = False) -> FrameRejected:
        self.frames_rejected[reason] = self.frames_rejected.get(reason, 0) + 1
        return FrameRefused(reason, message) if refused else FrameRejected(reason, message)

    def claim(self, unique_key: str) -> ClaimResult | None:
        """Take a complete or failed entry, exactly once; None if not ready or taken. A failed
        entry is taken even while a frame writes into it (`draining`: hold its blocks)."""
        with self._lock:
            entry = self._entries.get(unique_key)
            if entry is None or not entry.claimable(entry.unique_key in self._side):
                return None
            return self._take(entry)

    def _take(self, entry: ReceiveEntry) -> ClaimResult:
        del self._entries[entry.unique_key]
        if entry.writing:
            self._draining[entry.unique_key] = entry
        slot = self._side.pop(entry.unique_key, None)
        return entry.claim_result(slot.data if slot else None)

    def pop_released(self) -> list[str]:
        """Draining keys whose last writer finished since the last call."""
        with self._lock:
            keys = list(self._released)
            self._released.clear()
            return keys

    def pop_ready(self) -> list[str]:
        """Keys that became complete or failed since the last call (to try `claim` on)."""
        with self._lock:
            keys = list(self._ready)
            self._ready.clear()
            return keys

    def load_cache_sync(self, unique_key: str, deadline: float) -> ClaimResult:
        """Block until the entry is complete and claim it; raises KVLoadError naming the stage
        on failure, on timeout or if another claimer won. Deadlines here are absolute
        `time.time()` values, shared across nodes."""
        with self._lock:
            while True:
                entry = self._entries.get(unique_key)
                if entry is None:
                    if unique_key in self._tombstones:
                        message = f"unique key {unique_key} was cancelled"
                        raise KVLoadError(Failure(FailureReason.CANCELLED, message, "claim"))
                    message = f"unique key {unique_key} is not registered"
                    raise KVLoadError(Failure(FailureReason.INVALID_INPUT, message, "claim"))
                if entry.claimable(unique_key in self._side) and not entry.writing:
                    result = self._take(entry)
                    if result.failure is not None:
                        raise KVLoadError(result.failure)
                    return result
                remaining = deadline - time.time()
                if remaining <= 0:
                    stage = entry.stage.name.lower()
                    if entry.stage == TransferStage.DONE:
                        stage = "waiting for first token"
                    message = f"timed out waiting for KV of {unique_key}"
                    raise KVLoadError(Failure(FailureReason.DEADLINE, message, stage))
                self._changed.wait(remaining)

    def cancel(self, unique_key: str) -> bool:
        """Drop the entry and its side-channel data and keep late frames out, without waiting.
        True if a frame is still being written into its blocks: the owner holds them until the
        key is `pop_released`."""
        with self._lock:
            self._tombstones[unique_key] = time.monotonic() + TOMBSTONE_TTL_S
            self._side.pop(unique_key, None)
            entry = self._entries.pop(unique_key, None)
            self._changed.notify_all()
            if entry is None:
                return False
            entry.stage = TransferStage.FAILED
            entry.failure = entry.failure or Failure(FailureReason.CANCELLED, "cancelled")
            if entry.writing:
                self._draining[unique_key] = entry
            return bool(entry.writing)

    def sweep(self) -> list[str]:
        """Expire entries and side-channel data past their deadlines (entries are failed so
        their owner frees the blocks) and forget old tombstones. Returns expired keys."""
        now, mono = time.time(), time.monotonic()
        expired = []
        with self._lock:
            for key, entry in list(self._entries.items()):
                if entry.deadline <= now and entry.stage != TransferStage.FAILED:
                    message = f"deadline passed for {key}"
                    # Every layer in and no reply from prefill yet: say what was missing.
                    stage = "waiting for first token" if entry.stage == TransferStage.DONE else ""
                    self._fail_locked(entry, Failure(FailureReason.DEADLINE, message, stage))
                    expired.append(key)
            for key, slot in list(self._side.items()):
                if slot.deadline <= now and key not in self._entries:
                    del self._side[key]
                    expired.append(key)
            for key, until in list(self._tombstones.items()):
                if until <= mono:
                    del self._tombstones[key]
            self._changed.notify_all()
        return expired

    def expecting(self) -> bool:
        """Some entry still waits for frames (or drains)."""
        with self._lock:
            return bool(self._entries or self._draining)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                len(self._entries) + len(self._draining),
                len(self._side),
                len(self._tombstones),
                self.bytes_received,
                dict(self.frames_rejected),
            )
