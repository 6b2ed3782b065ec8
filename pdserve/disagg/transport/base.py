"""The transport interface, shaped like RDMA: memory regions are registered once; a write is a
list of (local blocks -> remote blocks) for one (request, layer) with a completion callback;
the receiving side hands every frame to the KV receiver (`Receive`, or `Open` for a transport
that keeps several writes in flight), which validates it and lets the transport fill the
target blocks.

A frame on a byte stream is: 4-byte big-endian header length, a TransferFrameHeader, then
`len(block_ids) * block_bytes` raw bytes (the blocks, in order).
"""

from __future__ import annotations

import queue
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import xxhash

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.transport.events import AsyncEvent, CompletedEvent
from pdserve.disagg.transport.regions import KVRegions
from pdserve.disagg.wire import data_header
from pdserve.engine.failure import Failure, FailureReason, RequestFailed

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


class FrameCorrupt(Exception):
    """A frame whose bytes, once in decode's blocks, do not match the checksum prefill sent
    (--kv-checksum): its request is failed (naming the peer and the layer), the sender gets a
    NACK, and the link stays up: the stream itself kept its framing."""

    reason = "checksum_mismatch"


class FrameRefused(FrameRejected):
    """A well-formed frame for a key that is not live (unknown, cancelled, failed or expired):
    its payload is drained, nothing is written, the sender gets a per-frame NACK with the
    reason, and the connection stays up for the other requests on it."""


# Per-frame acknowledgement bytes: the frame's bytes are in place, or it was refused (why).
ACK_OK = 1
NACK_REASONS = ("unknown_key", "cancelled_key", "failed_key", "foreign_link", FrameCorrupt.reason)


def nack_byte(reason: str) -> int:
    return 2 + NACK_REASONS.index(reason)


def nack_reason(byte: int) -> str:
    index = byte - 2
    return NACK_REASONS[index] if 0 <= index < len(NACK_REASONS) else f"code {byte}"


Completion = Callable[[TransportError | None], None]
# Fills the given target views (made as they are reached: iterate once) with exactly their
# sizes in bytes before the absolute `deadline` (time.time()); raises OSError on failure or
# when the deadline passes.
Fill = Callable[[Iterable[memoryview], float], None]
# The receiving end of the transport: validates a frame, then lets `fill` write its bytes.
# The int names the (authenticated) connection the frame came on: a key's frames are bound to
# the connection that sent its first one.
Receive = Callable[[pb.TransferFrameHeader, Fill, int], None]


@dataclass
class OpenFrame:
    """A validated DATA frame whose bytes may be written now, by `deadline` (absolute
    time.time()), into `views` (its target blocks, in payload order, made as they are reached:
    iterate once); `close(ok)` ends the write, exactly once: True once every byte is in, False
    if the write failed."""

    header: pb.TransferFrameHeader
    views: Iterable[memoryview]
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


def ready_after(first: LayerWrite, jobs: queue.Queue[Any], limit: int) -> list[LayerWrite]:
    """`first` and the writes queued right behind it whose layers are ready, up to `limit`:
    they go out together (consecutive layers of one request as one frame)."""
    batch = [first]
    while len(batch) < limit and not jobs.empty():
        nxt = jobs.queue[0]
        if not isinstance(nxt, LayerWrite) or not nxt.event.ready():
            break
        batch.append(jobs.get_nowait())
    return batch


def group_frames(writes: list[LayerWrite]) -> list[list[LayerWrite]]:
    """`writes` in order, consecutive layers of one request (the same blocks and heads) grouped:
    each group goes out as one frame."""
    groups: list[list[LayerWrite]] = []
    for w in writes:
        last = groups[-1][-1] if groups else None
        if (
            last is not None
            and w.unique_key == last.unique_key
            and w.layer == last.layer + 1
            and (w.head_start, w.head_count) == (last.head_start, last.head_count)
            and w.src_blocks == last.src_blocks
            and w.dst_blocks == last.dst_blocks
        ):
            groups[-1].append(w)
        else:
            groups.append([w])
    return groups


def layer_checksums(views: list[memoryview], layers: int) -> list[int]:
    """The xxh3-64 of each layer's bytes in `views` (a frame's payload: `layers` layers, the
    same number of views each, in order). xxHash's XXH3: ~20 GB/s a core, a few percent of a
    transfer's time."""
    per = len(views) // layers if layers else 0
    sums = []
    for i in range(layers):
        digest = xxhash.xxh3_64()
        for view in views[i * per : (i + 1) * per]:
            digest.update(view)
        sums.append(digest.intdigest())
    return sums


def encode_header(header: pb.TransferFrameHeader) -> bytes:
    body: bytes = header.SerializeToString()
    return HEADER_LEN.pack(len(body)) + body


def payload_bytes(header: pb.TransferFrameHeader) -> int:
    """The bytes that follow a DATA frame's header: each of its layers' blocks."""
    return len(header.block_ids) * header.block_bytes * (header.layer_count or 1)


class TransferSender:
    """Delivers LayerWrites; `done(None)` once the bytes left this node's block memory (the
    blocks may then be freed), `done(error)` otherwise. Writes to one peer keep their order.
    The keys cancelled (`cancel` .. `forget`) are kept here, for every transport alike."""

    regions: KVRegions  # the registered source memory
    # Fault injection for tests: a pause before each write, as on a slow network.
    testing_delay_s: float = 0.0
    checksum = False  # --kv-checksum: every DATA frame carries its layers' checksums

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

    def data_frame(
        self, group: list[LayerWrite]
    ) -> tuple[pb.TransferFrameHeader, Iterable[memoryview]]:
        """The header of the frame carrying `group` (consecutive layers of one request, the
        same blocks and heads: `group_frames`) and views of its payload in the source blocks,
        made as they are read (`KVRegions.stream_views`; all at once to checksum them).
        ValueError or IndexError for heads or a layer out of range."""
        first = group[0]
        layers = [w.layer for w in group]
        views = self.regions.stream_views(
            layers, first.src_blocks, first.head_start, first.head_count
        )
        if not self.checksum:
            return data_header(first, self.regions, len(group)), views
        listed = list(views)
        sums = layer_checksums(listed, len(group))
        return data_header(first, self.regions, len(group), sums), listed

    def frame_header(self, group: list[LayerWrite]) -> pb.TransferFrameHeader:
        """`data_frame`'s header alone (for a transport whose peer reads the bytes itself)."""
        if self.checksum:
            return self.data_frame(group)[0]
        return data_header(group[0], self.regions, len(group))

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

    def wake(self) -> None:
        """Frames are now expected (an entry was registered): a receiver that polls for them
        slowly while idle polls at once (any thread)."""

    def stop(self) -> None:
        raise NotImplementedError
