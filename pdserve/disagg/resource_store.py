"""Decode-side bookkeeping of KV handoffs, keyed by unique key. Thread-safe: receiver threads
write frames, the event loop delivers side-channel data, the engine thread claims.

Lifecycle of an entry: `register` (target blocks, expected sizes, absolute deadline) -> frames
arrive layer by layer (`begin_frame` / `end_frame`) -> complete when every layer arrived and the
side channel holds the first token -> exactly one `claim` takes it. `fail` records an error
(the claimer gets it); `cancel` removes the entry and leaves a tombstone so late frames are
rejected; `sweep` expires entries, side-channel data and tombstones past their deadlines.
Side-channel data (first token, its logprob, reuse lengths) lives in its own map with its own
deadline, so it is kept whether it arrives before or after the KV.

Every wait is on a condition with an absolute deadline; nothing sleeps in a loop.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

TOMBSTONE_TTL_S = 60.0


class TransferStage(enum.IntEnum):
    """Ordered: an update keeps the maximum, so a late message never moves an entry back."""

    FAILED = 0
    WAITING = 1  # registered, no frame yet
    TRANSFERRING = 2
    DONE = 3  # every layer arrived (the side channel may still be pending)


class FrameRejected(Exception):
    """A frame does not match a live entry; `reason` is a short metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class KVLoadError(RuntimeError):
    """Waiting for or claiming a handoff failed; the message names the key and the stage."""

    def __init__(self, message: str, stage: str, timeout: bool = False) -> None:
        super().__init__(message)
        self.stage = stage
        self.timeout = timeout


@dataclass(frozen=True)
class SideChannelData:
    has_first_token: bool
    first_token: int = 0
    first_logprob: float = 0.0
    num_skipped_blocks: int = 0
    num_prefill_cached_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # prefill's milestones


@dataclass
class ReceiveEntry:
    unique_key: str
    request_id: str
    block_ids: frozenset[int]  # decode blocks this handoff may write
    num_blocks_expected: int  # blocks per layer that will be sent (after skipping)
    num_layers: int
    block_bytes: int
    deadline: float
    stage: TransferStage = TransferStage.WAITING
    layers_done: set[int] = field(default_factory=set)
    blocks_per_layer: dict[int, int] = field(default_factory=dict)
    writing: int = 0  # frames being written into the blocks right now
    bytes_received: int = 0
    error: str | None = None
    first_frame_at: float | None = None
    done_at: float | None = None


@dataclass(frozen=True)
class ClaimResult:
    unique_key: str
    request_id: str
    side_channel: SideChannelData | None
    error: str | None
    stage: str
    bytes_received: int
    done_at: float | None


@dataclass
class _SideChannelSlot:
    data: SideChannelData
    deadline: float


class ResourceStore:
    def __init__(self, on_ready: Callable[[str], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._entries: dict[str, ReceiveEntry] = {}
        self._side: dict[str, _SideChannelSlot] = {}
        self._tombstones: dict[str, float] = {}  # key -> when to forget it
        self._ready: deque[str] = deque()  # complete or failed, not yet claimed
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
    ) -> None:
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
            )
            if num_blocks_expected == 0:  # everything was cached on decode
                self._mark_done(self._entries[unique_key])

    # ---- frames (receiver threads) ----------------------------------------------------

    def begin_frame(
        self, unique_key: str, layer: int, block_ids: list[int], block_bytes: int
    ) -> ReceiveEntry:
        """Validate a frame header before any byte is written; raises FrameRejected."""
        with self._lock:
            entry = self._entries.get(unique_key)
            if entry is None:
                reason = "cancelled_key" if unique_key in self._tombstones else "unknown_key"
                raise self.reject(reason, f"frame for {reason.replace('_', ' ')} {unique_key}")
            problem = self._frame_problem(entry, layer, block_ids, block_bytes)
            if problem is not None:
                reason, message = problem
                self._fail_locked(entry, f"rejected a frame: {message}")
                raise self.reject(reason, f"unique key {unique_key}: {message}")
            entry.writing += 1
            entry.stage = max(entry.stage, TransferStage.TRANSFERRING)
            entry.first_frame_at = entry.first_frame_at or time.time()
            return entry

    def _frame_problem(
        self, entry: ReceiveEntry, layer: int, block_ids: list[int], block_bytes: int
    ) -> tuple[str, str] | None:
        if entry.stage == TransferStage.FAILED:
            return "failed_key", f"entry already failed ({entry.error})"
        if not 0 <= layer < entry.num_layers:
            return "bad_layer", f"layer {layer} outside [0, {entry.num_layers})"
        if block_bytes != entry.block_bytes:
            return "wrong_size", f"block of {block_bytes} bytes, expected {entry.block_bytes}"
        stray = [b for b in block_ids if b not in entry.block_ids]
        if stray:
            return "foreign_block", f"blocks {stray[:4]} are not this request's targets"
        if entry.blocks_per_layer.get(layer, 0) + len(block_ids) > entry.num_blocks_expected:
            return "extra_blocks", f"layer {layer} got more than {entry.num_blocks_expected} blocks"
        return None

    def end_frame(self, entry: ReceiveEntry, layer: int, num_blocks: int, ok: bool) -> None:
        with self._lock:
            entry.writing -= 1
            if ok:
                entry.bytes_received += num_blocks * entry.block_bytes
                self.bytes_received += num_blocks * entry.block_bytes
                got = entry.blocks_per_layer.get(layer, 0) + num_blocks
                entry.blocks_per_layer[layer] = got
                if got == entry.num_blocks_expected:
                    entry.layers_done.add(layer)
                if len(entry.layers_done) == entry.num_layers:
                    self._mark_done(entry)
            else:
                self._fail_locked(entry, f"connection lost while receiving layer {layer}")
            if entry.writing == 0 and entry.stage == TransferStage.FAILED:
                self._push_ready(entry.unique_key)  # claimable now that no frame writes
            self._changed.notify_all()

    def layers_received(self, unique_key: str) -> set[int]:
        with self._lock:
            entry = self._entries.get(unique_key)
            return set(entry.layers_done) if entry else set()

    def wait_for_layer(self, unique_key: str, layer: int, deadline: float) -> bool:
        """Test/diagnostic helper: True once `layer` of `unique_key` has fully arrived."""
        with self._lock:
            while True:
                entry = self._entries.get(unique_key)
                if entry is not None and layer in entry.layers_done:
                    return True
                remaining = deadline - time.time()
                if remaining <= 0:
                    return False
                self._changed.wait(remaining)

    # ---- side channel ------------------------------------------------------------------

    def put_side_channel(self, unique_key: str, data: SideChannelData, deadline: float) -> bool:
        """Store the first token etc.; dropped (False) if past its deadline or cancelled."""
        with self._lock:
            if time.time() >= deadline or unique_key in self._tombstones:
                return False
            self._side[unique_key] = _SideChannelSlot(data, deadline)
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

    def fail(self, unique_key: str, error: str) -> None:
        with self._lock:
            entry = self._entries.get(unique_key)
            if entry is not None:
                self._fail_locked(entry, error)
                self._changed.notify_all()

    def _fail_locked(self, entry: ReceiveEntry, error: str) -> None:
        if entry.stage == TransferStage.FAILED:
            return
        stage = entry.stage.name.lower()
        entry.error = f"{error} (stage: {stage})"
        entry.stage = TransferStage.FAILED
        self._push_ready(entry.unique_key)

    def reject(self, reason: str, message: str) -> FrameRejected:
        self.frames_rejected[reason] = self.frames_rejected.get(reason, 0) + 1
        return FrameRejected(reason, message)

    def _complete(self, entry: ReceiveEntry) -> bool:
        return entry.stage == TransferStage.FAILED or (
            entry.stage == TransferStage.DONE and entry.unique_key in self._side
        )

    def claim(self, unique_key: str) -> ClaimResult | None:
        """Take a complete or failed entry, exactly once; None if not ready or taken."""
        with self._lock:
            entry = self._entries.get(unique_key)
            if entry is None or not self._complete(entry) or entry.writing:
                return None
            return self._take(entry)

    def _take(self, entry: ReceiveEntry) -> ClaimResult:
        del self._entries[entry.unique_key]
        slot = self._side.pop(entry.unique_key, None)
        return ClaimResult(
            entry.unique_key,
            entry.request_id,
            slot.data if slot else None,
            entry.error,
            entry.stage.name.lower(),
            entry.bytes_received,
            entry.done_at,
        )

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
                        raise KVLoadError(f"unique key {unique_key} was cancelled", "cancelled")
                    raise KVLoadError(f"unique key {unique_key} is not registered", "claim")
                if self._complete(entry) and not entry.writing:
                    result = self._take(entry)
                    if result.error:
                        raise KVLoadError(result.error, result.stage)
                    return result
                remaining = deadline - time.time()
                if remaining <= 0:
                    stage = entry.stage.name.lower()
                    if entry.stage == TransferStage.DONE:
                        stage = "waiting for first token"
                    raise KVLoadError(
                        f"timed out waiting for KV of {unique_key} (stage: {stage})",
                        stage,
                        timeout=True,
                    )
                self._changed.wait(remaining)

    def cancel(self, unique_key: str, abort_writers: Callable[[], None] | None = None) -> None:
        """Drop the entry and its side-channel data and keep late frames out. Returns once no
        frame is being written into its blocks (the owner may then free them)."""
        with self._lock:
            self._tombstones[unique_key] = time.monotonic() + TOMBSTONE_TTL_S
            self._side.pop(unique_key, None)
            entry = self._entries.pop(unique_key, None)
            self._changed.notify_all()
            if entry is None:
                return
            entry.stage = TransferStage.FAILED
            entry.error = entry.error or "cancelled"
            if entry.writing and not self._changed.wait_for(lambda: not entry.writing, 2.0):
                if abort_writers is not None:
                    self._lock.release()
                    try:
                        abort_writers()
                    finally:
                        self._lock.acquire()
                self._changed.wait_for(lambda: not entry.writing, 5.0)

    def sweep(self) -> list[str]:
        """Expire entries and side-channel data past their deadlines (entries are failed so
        their owner frees the blocks) and forget old tombstones. Returns expired keys."""
        now, mono = time.time(), time.monotonic()
        expired = []
        with self._lock:
            for key, entry in list(self._entries.items()):
                if entry.deadline <= now and entry.stage != TransferStage.FAILED:
                    self._fail_locked(entry, f"deadline passed for {key}")
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

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self._entries),
                "side_channel": len(self._side),
                "tombstones": len(self._tombstones),
            }

    def writing(self, unique_key: str) -> int:
        with self._lock:
            entry = self._entries.get(unique_key)
            return entry.writing if entry else 0
