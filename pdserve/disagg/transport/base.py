"""The transport interface, shaped like RDMA: memory regions are registered once; a write is a
list of (local blocks -> remote blocks) for one (request, layer) with a completion callback;
the receiving side hands every frame to the KV receiver (`Receive`, or `Open` for a transport
that keeps several writes in flight), which validates it and lets the transport fill the
target blocks.

A frame on a byte stream is: 4-byte big-endian header length, a TransferFrameHeader, then
`len(block_ids) * block_bytes` raw bytes (the blocks, in order).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.transport.events import AsyncEvent, CompletedEvent
from pdserve.engine.failure import Failure, FailureReason, RequestFailed
from pdserve.engine.kv_cache import KVShard

HEADER_LEN = struct.Struct(">I")
# A header names at most one layer's blocks of one prompt: 64 KiB holds ~13,000 block ids
# (200,000 tokens at block size 16).
MAX_HEADER_BYTES = 64 << 10


class TransportError(RequestFailed):
    """A write could not be delivered; its failure names the peer, the unique key and the
    stage."""


class FrameRejected(Exception):
    """A protocol violation (malformed header, wrong size, out-of-range, foreign or duplicate
    block): nothing is written and the connection is closed. `reason` is a metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class FrameRefused(FrameRejected):
    """A well-formed frame for a key that is not live (unknown, cancelled, failed or expired):
    its payload is drained, nothing is written, the sender gets a per-frame NACK with the
    reason, and the connection stays up for the other requests on it."""


# Per-frame acknowledgement bytes: the frame's bytes are in place, or it was refused (why).
ACK_OK = 1
NACK_REASONS = ("unknown_key", "cancelled_key", "failed_key", "foreign_link")


def nack_byte(reason: str) -> int:
    return 2 + NACK_REASONS.index(reason)


def nack_reason(byte: int) -> str:
    index = byte - 2
    return NACK_REASONS[index] if 0 <= index < len(NACK_REASONS) else f"code {byte}"


Completion = Callable[[TransportError | None], None]
# Fills the given target views with exactly their sizes in bytes before the absolute
# `deadline` (time.time()); raises OSError on failure or when the deadline passes.
Fill = Callable[[list[memoryview], float], None]
# The receiving end of the transport: validates a frame, then lets `fill` write its bytes.
# The int names the (authenticated) connection the frame came on: a key's frames are bound to
# the connection that sent its first one.
Receive = Callable[[pb.TransferFrameHeader, Fill, int], None]


@dataclass
class OpenFrame:
    """A validated DATA frame whose bytes may be written now, by `deadline` (absolute
    time.time()), into `views` (its target blocks, in payload order); `close(ok)` ends the
    write, exactly once: True once every byte is in, False if the write failed."""

    header: pb.TransferFrameHeader
    views: list[memoryview]
    deadline: float
    close: Callable[[bool], None]


# `Receive` split in two, for a transport that keeps several writes in flight: validates a
# frame and opens its write; None for a frame without payload (a FAILURE), handled at once.
# Raises what `Receive` raises.
Open = Callable[[pb.TransferFrameHeader, int], OpenFrame | None]


class FrameSink(Protocol):
    """What a receiver hands frames to (the KV receiver): both forms of one check."""

    def receive(self, header: pb.TransferFrameHeader, fill: Fill, link: int = 0) -> None: ...

    def open(self, header: pb.TransferFrameHeader, link: int = 0) -> OpenFrame | None: ...


class KVRegions:
    """Registered KV memory: per layer a byte view [num_blocks, block_bytes] of the cache tensor
    (each block one contiguous range, DESIGN.md §5). No copies: views of the live tensors.

    A tensor-parallel node registers every rank's shard (rank 0 shares their memory): a frame
    carries heads [head_start, head_start + head_count) of one layer, which lie within one
    shard, K then V per block. `frame_heads` splits the heads where either side's shards do,
    so each head crosses the wire once and every frame lands within one receiving shard."""

    def __init__(self, caches: list[torch.Tensor], shards: list[KVShard] | None = None) -> None:
        self.shards = shards if shards is not None else [KVShard(0, caches)]
        caches = self.shards[0].caches
        self.layers: list[np.ndarray] = [
            c.view(torch.uint8).reshape(c.shape[0], -1).numpy() for c in caches
        ]
        self.num_layers = len(caches)
        self.num_blocks = caches[0].shape[0] if caches else 0
        self.num_kv_heads = max((s.head_start + s.num_heads for s in self.shards), default=0)
        # K and V of one head in one block; a block of all heads is `block_bytes`.
        self.head_bytes = (self.layers[0].shape[1] // self.shards[0].num_heads) if caches else 0
        self.block_bytes = self.head_bytes * self.num_kv_heads
        self.bounds = sorted({b for s in self.shards for b in (s.head_start, s.end)})
        # One flat byte view per (shard, layer); a block range is a cheap slice of it.
        self._flat = [[_bytes_of(c) for c in s.caches] for s in self.shards]

    @classmethod
    def sharded(cls, shards: list[KVShard]) -> KVRegions:
        return cls(shards[0].caches, shards)

    def holders(self, head_start: int, head_count: int) -> list[int]:
        """The shards holding heads [head_start, +head_count) whole (several where ranks
        replicate them)."""
        end = head_start + head_count
        return [i for i, s in enumerate(self.shards) if s.head_start <= head_start and end <= s.end]

    def holder(self, head_start: int, head_count: int) -> int | None:
        """The first shard holding heads [head_start, +head_count) whole, or None."""
        found = self.holders(head_start, head_count)
        return found[0] if found else None

    def frame_heads(self, peer_bounds: list[int]) -> list[tuple[int, int]]:
        """(head_start, head_count) per frame of a layer sent to a peer whose shards split the
        heads at `peer_bounds` (e.g. [0, 2, 4]): split wherever either side's shards split."""
        cuts = sorted(set(self.bounds) | set(peer_bounds))
        return [(a, b - a) for a, b in zip(cuts, cuts[1:], strict=False)]

    def views(
        self, layer: int, blocks: list[int], head_start: int = 0, head_count: int = 0
    ) -> list[memoryview]:
        """Byte views covering heads [head_start, +head_count) (0: all) of `blocks` in order,
        K then V per block, in the first shard holding them: one view per run of consecutive
        block ids when the frame is the shard's every head, else two per block."""
        head_count = head_count or self.num_kv_heads
        index = self.holder(head_start, head_count)
        if index is None:
            raise ValueError(f"no shard holds heads [{head_start}, +{head_count})")
        shard, flat = self.shards[index], self._flat[index][layer]
        size = self.head_bytes * shard.num_heads
        if head_count == shard.num_heads:
            return [flat[start * size : (start + n) * size] for start, n in runs(blocks)]
        half = self.head_bytes // 2  # K (or V) of one head in one block
        k = (head_start - shard.head_start) * half
        v = k + shard.num_heads * half
        out: list[memoryview] = []
        for b in blocks:
            base = b * size
            out.append(flat[base + k : base + k + head_count * half])
            out.append(flat[base + v : base + v + head_count * half])
        return out

    def mirror(self, layer: int, blocks: list[int], head_start: int, head_count: int) -> None:
        """Copy heads just written into their first holder to every other shard that holds
        them too (ranks replicating KV heads when there are fewer heads than ranks)."""
        first, *replicas = self.holders(head_start, head_count)
        if not replicas:  # the common case: nothing to copy
            return
        src = self.shards[first]
        index = torch.tensor(blocks, dtype=torch.long)
        lo = head_start - src.head_start
        heads = src.caches[layer][index, :, lo : lo + head_count]
        for i in replicas:
            at = head_start - self.shards[i].head_start
            self.shards[i].caches[layer][index, :, at : at + head_count] = heads

    def clear_tail(self, block: int, first_slot: int) -> None:
        """Zero token slots [first_slot, block_size) of `block` in every layer of every shard
        (the cache layout is [blocks, K/V, kv heads, slots, head dim])."""
        for shard in self.shards:
            for cache in shard.caches:
                cache[block, :, :, first_slot:, :].zero_()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous tensor's memory."""
    return memoryview(tensor.view(torch.uint8).reshape(-1).numpy()).cast("B")  # type: ignore[arg-type]  # numpy's buffer, typed narrowly


def runs(blocks: list[int]) -> list[tuple[int, int]]:
    """[(first, count)] for runs of consecutive ids: 3,4,5,9 -> (3,3),(9,1)."""
    return [(first, count) for first, _, count in pair_runs(blocks, blocks)]


def pair_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """[(src first, dst first, count)] for runs where both ids are consecutive. (A frame's
    hot path: one comparison per block, a tuple per run.)"""
    out: list[tuple[int, int, int]] = []
    if not src:
        return out
    s0, d0, n = src[0], dst[0], 1
    for s, d in zip(src[1:], dst[1:], strict=True):
        if s == s0 + n and d == d0 + n:
            n += 1
            continue
        out.append((s0, d0, n))
        s0, d0, n = s, d, 1
    out.append((s0, d0, n))
    return out


@dataclass
class LayerWrite:
    """One (request, layer) transfer: local `src_blocks` -> remote `dst_blocks`."""

    peer: str  # host:port of the receiver
    unique_key: str
    layer: int
    src_blocks: list[int]
    dst_blocks: list[int]
    deadline: float  # absolute time.time()
    done: Completion
    event: AsyncEvent = field(default_factory=CompletedEvent)
    head_start: int = 0  # the KV heads this write moves (head_count 0: all of them)
    head_count: int = 0

    @property
    def where(self) -> str:
        return f"peer {self.peer}, unique key {self.unique_key}, layer {self.layer}"

    def error(self, reason: FailureReason, message: str, stage: str) -> TransportError:
        return TransportError(Failure(reason, f"{message} ({self.where})", stage, self.peer))


def frame_block_bytes(regions: KVRegions, head_count: int) -> int:
    """Bytes per block of a frame carrying `head_count` heads (0: all)."""
    return regions.head_bytes * (head_count or regions.num_kv_heads)


def data_header(write: LayerWrite, regions: KVRegions) -> pb.TransferFrameHeader:
    return pb.TransferFrameHeader(
        kind=pb.TransferFrameHeader.DATA,
        unique_key=write.unique_key,
        layer=write.layer,
        block_ids=write.dst_blocks,
        head_start=write.head_start,
        head_count=write.head_count or regions.num_kv_heads,
        block_bytes=frame_block_bytes(regions, write.head_count),
    )


def failure_header(unique_key: str, failure: Failure) -> pb.TransferFrameHeader:
    return pb.TransferFrameHeader(
        kind=pb.TransferFrameHeader.FAILURE,
        unique_key=unique_key,
        error=failure.message,
        reason=failure.reason.value,
        stage=failure.stage,
    )


def encode_header(header: pb.TransferFrameHeader) -> bytes:
    body: bytes = header.SerializeToString()
    return HEADER_LEN.pack(len(body)) + body


class TransferSender:
    """Delivers LayerWrites; `done(None)` once the bytes left this node's block memory (the
    blocks may then be freed), `done(error)` otherwise. Writes to one peer keep their order.
    The keys cancelled (`cancel` .. `forget`) are kept here, for every transport alike."""

    regions: KVRegions  # the registered source memory
    # Fault injection for tests: a pause before each write, as on a slow network.
    testing_delay_s: float = 0.0

    def __init__(self) -> None:
        self._cancelled: set[str] = set()
        self._cancelled_lock = threading.Lock()

    def is_cancelled(self, unique_key: str) -> bool:
        with self._cancelled_lock:
            return unique_key in self._cancelled

    def held_back(self, write: LayerWrite) -> TransportError | None:
        """Once its layer is ready: the error a write must complete with instead of being
        sent (its key was cancelled), or None (after the testing delay, if any)."""
        if self.testing_delay_s and not self.is_cancelled(write.unique_key):
            time.sleep(self.testing_delay_s)
        if self.is_cancelled(write.unique_key):
            return write.error(FailureReason.CANCELLED, "cancelled before sending", "sending")
        return None

    def submit(self, write: LayerWrite) -> None:
        raise NotImplementedError

    def address_problem(self, peer: str) -> str | None:
        """Why `peer` cannot be a receiver address for this transport, or None."""
        return None

    def register_peer(self, peer: str, metadata: bytes) -> str | None:
        """A decode's probe registers its receiver `peer` with the transport's `metadata` (what
        its receiver's `metadata` returned); why it cannot be used, or None."""
        return self.address_problem(peer)

    def metadata(self) -> bytes:
        """What a receiver needs to know of this sender (for `TransferReceiver.add_peer`)."""
        return b""

    def send_failure(self, peer: str, unique_key: str, failure: Failure) -> None:
        """Tell the receiver this key will get no more data (best effort)."""

    def cancel(self, unique_key: str) -> None:
        """Complete this key's queued writes with an error without sending them."""
        with self._cancelled_lock:
            self._cancelled.add(unique_key)

    def forget(self, unique_key: str) -> None:
        """Every write of this key has completed: drop what `cancel` remembered."""
        with self._cancelled_lock:
            self._cancelled.discard(unique_key)

    def close(self) -> None:
        raise NotImplementedError

    @property
    def bytes_sent(self) -> int:
        return 0

    @property
    def links_opened(self) -> int:
        """Connections made to receivers, reconnects included (0 where there are none)."""
        return 0


class TransferReceiver:
    """The receiving end: frames that arrive go to the `Receive` function it was made with."""

    address: str  # where this receiver listens

    def advertised(self, host: str | None) -> str:
        """The address to tell senders: `address`, with its host replaced by `host` if set."""
        return self.address

    def stats(self) -> dict[str, int]:
        """Connection events by kind (refused, failed handshakes, ...), for metrics."""
        return {}

    def metadata(self) -> bytes:
        """What a sender needs to know of this receiver (for `TransferSender.register_peer`)."""
        return b""

    def add_peer(self, metadata: bytes) -> None:
        """Learn a sender from its `metadata` (a prefill's probe answer)."""

    def stop(self) -> None:
        raise NotImplementedError
