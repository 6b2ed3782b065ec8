"""What decode knows about one KV handoff: its receive entry (target blocks, expected sizes,
deadline, ordered stage, typed failure) and the frame checks against it, the side-channel data
prefill returns, and what a claim hands to the engine. Plain data; the resource store owns the
entries and their locking."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.disagg.wire import SideChannelData
from pdserve.engine.failure import Failure, FailureReason, RequestFailed


class TransferStage(enum.IntEnum):
    """Ordered: an update keeps the maximum, so a late message never moves an entry back."""

    FAILED = 0
    WAITING = 1  # registered, no frame yet
    TRANSFERRING = 2
    DONE = 3  # every layer arrived (the side channel may still be pending)


class KVLoadError(RequestFailed):
    """Waiting for or claiming a handoff failed; the failure names the key and the stage."""

    @property
    def timeout(self) -> bool:
        return self.failure.reason == FailureReason.DEADLINE


@dataclass
class ReceiveEntry:
    unique_key: str
    request_id: str
    block_ids: frozenset[int]  # decode blocks this handoff may write
    # blocks each layer will be sent (after skipping; a windowed layer's: its window's)
    blocks_expected: tuple[int, ...]
    num_layers: int
    block_bytes: int  # K and V of every KV head of one block in one layer
    deadline: float
    num_kv_heads: int = 1  # frames may carry a slice of them (tensor-parallel peers)
    peer: str = ""  # the prefill node sending it, once chosen
    link: int | None = None  # the connection its frames are bound to, from the first one
    stage: TransferStage = TransferStage.WAITING
    layers_done: set[int] = field(default_factory=set)
    heads_per_layer: dict[int, int] = field(default_factory=dict)  # (block, head) pairs in
    writing: int = 0  # frames being written into the blocks right now
    bytes_received: int = 0
    failure: Failure | None = None
    done_at: float | None = None

    def claimable(self, has_side_channel: bool) -> bool:
        """Failed (at once, even while a frame still writes), or complete and not writing."""
        if self.stage == TransferStage.FAILED:
            return True
        return self.stage == TransferStage.DONE and has_side_channel and not self.writing

    def claim_result(self, side_channel: SideChannelData | None) -> ClaimResult:
        return ClaimResult(
            self.unique_key,
            self.request_id,
            side_channel,
            self.failure,
            self.bytes_received,
            self.done_at,
            draining=bool(self.writing),
        )

    def frame_problem(
        self, layers: Sequence[int], block_ids: list[int], block_bytes: int, head_count: int = 0
    ) -> tuple[str, str] | None:
        """(metric label, message) if a frame with this header (the same `block_ids` in each
        of `layers`, `head_count` KV heads, 0: all) must not be written."""
        entry = self
        heads = head_count or entry.num_kv_heads
        if not layers:
            return "bad_layer", "a frame of no layer"
        if bad := [layer for layer in layers if not 0 <= layer < entry.num_layers]:
            return "bad_layer", f"layer {bad[0]} outside [0, {entry.num_layers})"
        expected = entry.block_bytes * heads // entry.num_kv_heads
        if block_bytes != expected:
            return "wrong_size", f"block of {block_bytes} bytes, expected {expected}"
        if not entry.block_ids.issuperset(block_ids):
            stray = [b for b in block_ids if b not in entry.block_ids]
            return "foreign_block", f"blocks {stray[:4]} are not this request's targets"
        for layer in layers:
            got = entry.heads_per_layer.get(layer, 0) + len(block_ids) * heads
            expected = entry.blocks_expected[layer]
            if got > expected * entry.num_kv_heads:
                return "extra_blocks", f"layer {layer} got more than {expected} blocks"
        return None


@dataclass
class SideChannelSlot:
    data: SideChannelData
    deadline: float


@dataclass(frozen=True)
class StoreStats:
    entries: int  # draining ones included: their blocks are not free yet
    side_channel: int
    tombstones: int
    bytes_received: int
    frames_rejected: dict[str, int]  # by reason


@dataclass(frozen=True)
class ClaimResult:
    unique_key: str
    request_id: str
    side_channel: SideChannelData | None
    failure: Failure | None
    bytes_received: int
    done_at: float | None
    draining: bool = False  # a frame still writes into the blocks: hold them until released

    @property
    def error(self) -> str | None:
        return None if self.failure is None else str(self.failure)


@dataclass(frozen=True)
class EntryProgress:
    """What an entry has received so far (for diagnostics and tests)."""

    stage: TransferStage
    layers_done: frozenset[int]
    writing: int
