"""Decode-side bookkeeping of KV handoffs, keyed by unique key. Thread-safe: receiver threads
write frames, the event loop delivers side-channel data, the engine thread claims.

Lifecycle of an entry: `register` (target blocks, expected sizes, absolute deadline) -> frames
of one or more layers arrive (`begin_frame` / `end_frame`) -> complete when every layer arrived
and the side channel holds the first token -> exactly one `claim` takes it. `fail` records an error
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

import time
from collections.abc import Sequence

from pdserve.disagg.frame_intake import FrameIntake
from pdserve.disagg.receive_entry import (
    ClaimResult,
    EntryProgress,
    KVLoadError,
    ReceiveEntry,
    SideChannelSlot,
    StoreStats,
    TransferStage,
)
from pdserve.disagg.wire import SideChannelData
from pdserve.engine.failure import Failure, FailureReason

TOMBSTONE_TTL_S = 60.0


class ResourceStore(FrameIntake):
    """See the module's docstring; the frames' side is `FrameIntake`'s."""

    # ---- registration -------------------------------------------------------------------

    def register(
        self,
        unique_key: str,
        request_id: str,
        block_ids: list[int],
        blocks_expected: int | Sequence[int],
        num_layers: int,
        block_bytes: int,
        deadline: float,
        num_kv_heads: int = 1,
    ) -> None:
        """`blocks_expected`: the blocks every layer (int) or each layer will be sent;
        `block_bytes`: a block's K and V of all `num_kv_heads` heads in one layer."""
        if isinstance(blocks_expected, int):
            expected = (blocks_expected,) * num_layers
        else:
            expected = tuple(blocks_expected)
        if len(expected) != num_layers:
            raise ValueError(f"{len(expected)} layers' block counts for {num_layers} layers")
        with self._lock:
            if unique_key in self._entries or unique_key in self._tombstones:
                raise ValueError(f"unique key {unique_key} is already in use")
            entry = ReceiveEntry(
                unique_key,
                request_id,
                frozenset(block_ids),
                expected,
                num_layers,
                block_bytes,
                deadline,
                num_kv_heads=num_kv_heads,
            )
            self._entries[unique_key] = entry
            entry.layers_done.update(i for i, n in enumerate(expected) if n == 0)
            if len(entry.layers_done) == num_layers:  # everything was cached on decode
                self._mark_done(entry)
        if self._on_register is not None:
            self._on_register()

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
