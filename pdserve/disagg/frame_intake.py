"""The resource store's state and its receiver-thread side: frames are validated before a byte
is written (`begin_frame`), counted in when written (`end_frame`), and a violation or a FAILURE
frame fails the entry it names, only from the connection that entry is bound to. The store
itself (`resource_store`) adds registration, the side channel, claims, cancels and the sweep.
Thread-safe: every method holds the one lock."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from pdserve.disagg.receive_entry import (
    ReceiveEntry,
    SideChannelSlot,
    TransferStage,
)
from pdserve.disagg.transport.base import FrameRefused, FrameRejected
from pdserve.engine.failure import Failure, FailureReason


class FrameIntake:
    def __init__(
        self,
        on_ready: Callable[[str], None] | None = None,
        on_register: Callable[[], None] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._entries: dict[str, ReceiveEntry] = {}
        self._side: dict[str, SideChannelSlot] = {}
        self._tombstones: dict[str, float] = {}  # key -> when to forget it
        self._ready: deque[str] = deque()  # complete or failed, not yet claimed
        self._draining: dict[str, ReceiveEntry] = {}  # taken, a frame still writing
        self._released: deque[str] = deque()  # draining keys whose last writer is out
        self._on_ready = on_ready  # a key became claimable (or released)
        self._on_register = on_register  # frames are expected: a polling receiver polls now
        self.frames_rejected: dict[str, int] = {}
        self.bytes_received = 0

    def _mark_done(self, entry: ReceiveEntry) -> None:
        entry.stage = TransferStage.DONE
        entry.done_at = time.time()
        if entry.unique_key in self._side:
            self._push_ready(entry.unique_key)

    def _push_ready(self, unique_key: str) -> None:
        self._ready.append(unique_key)
        if self._on_ready is not None:
            self._on_ready(unique_key)

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
        layers: Sequence[int],
        block_ids: list[int],
        block_bytes: int,
        link: int = 0,
        head_count: int = 0,
    ) -> ReceiveEntry:
        """Validate a frame header (the same `block_ids` in each of `layers`, of `head_count`
        KV heads, 0: all) before any byte is written; raises FrameRejected. One lock and one
        check of the blocks for the whole frame (a frame of 30 layers took 30 of each)."""
        with self._lock:
            entry = self._bound_entry_locked(unique_key, link)
            if entry.stage == TransferStage.FAILED:
                message = f"unique key {unique_key}: entry already failed ({entry.failure})"
                raise self._reject_locked("failed_key", message, refused=True)
            problem = entry.frame_problem(layers, block_ids, block_bytes, head_count)
            if problem is not None:
                reason, message = problem
                failure = Failure(FailureReason.TRANSFER_FAILED, f"rejected a frame: {message}")
                self._fail_locked(entry, failure)
                raise self._reject_locked(reason, f"unique key {unique_key}: {message}")
            entry.writing += 1
            entry.stage = max(entry.stage, TransferStage.TRANSFERRING)
            return entry

    def end_frame(
        self,
        entry: ReceiveEntry,
        layers: Sequence[int],
        num_blocks: int,
        ok: bool,
        head_count: int = 0,
        failure: Failure | None = None,
    ) -> None:
        """A frame's write into `entry`'s blocks (`num_blocks` in each of `layers`) ended:
        counted in if `ok`, else the entry fails (with `failure`, by default as a connection
        lost mid-frame)."""
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
                for layer in layers:
                    entry.bytes_received += nbytes
                    self.bytes_received += nbytes
                    got = entry.heads_per_layer.get(layer, 0) + num_blocks * heads
                    entry.heads_per_layer[layer] = got
                    if got == entry.blocks_expected[layer] * entry.num_kv_heads:
                        entry.layers_done.add(layer)
                if len(entry.layers_done) == entry.num_layers:
                    self._mark_done(entry)
            else:
                message = f"connection lost while receiving layers {layers[0]}-{layers[-1]}"
                failure = failure or Failure(FailureReason.TRANSFER_FAILED, message)
                self._fail_locked(entry, failure)
            if entry.writing == 0 and entry.stage == TransferStage.FAILED:
                self._push_ready(entry.unique_key)  # claimable now that no frame writes
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
