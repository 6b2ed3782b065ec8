"""Decode side of a transfer: validates each frame against the resource store and lets the
transport write the bytes straight into the target blocks (never into a staging buffer).

A frame is accepted only if its header keeps the protocol (layers and blocks in range, no
block twice, exact sizes), its key is registered and live and every block one of that entry's
targets. A protocol violation closes the connection; a frame for a key that is not live
(unknown, cancelled, failed, expired) is refused alone and the link stays up. Nothing is
written either way, and every rejection is counted. A FAILURE frame fails the entry with the
reason prefill sent; it carries no payload, so one that names blocks is a violation. A frame
may carry several consecutive layers (the same blocks and heads in each, one after another)
and a slice of the KV heads (a tensor-parallel peer): the slice must lie within one of this
node's shards, and heads that several ranks replicate are copied to each after the write. A
key's frames (FAILURE included) are bound to the connection that sent its first one: a frame
for it on another connection is refused and touches nothing.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.receive_entry import ReceiveEntry
from pdserve.disagg.resource_store import ResourceStore
from pdserve.disagg.transport.base import Fill, FrameCorrupt, OpenFrame, layer_checksums
from pdserve.disagg.transport.regions import KVRegions
from pdserve.disagg.wire import failure_of_header, frame_block_bytes
from pdserve.engine.failure import Failure, FailureReason

logger = logging.getLogger(__name__)


class KVReceiver:
    """`verify` (--kv-checksum): every DATA frame must carry its layers' checksums, and the
    bytes written into decode's blocks are checked against them before the frame counts; a
    mismatch fails that request alone (KV_CORRUPT, naming the peer and the layer), NACKs the
    frame and is counted per peer in `checksum_failures`. `testing_corrupt_frame` (fault
    injection for tests): one byte of the n-th DATA frame (from 1) is flipped in decode's
    blocks once it arrived, as if corrupted in flight."""

    def __init__(
        self,
        store: ResourceStore,
        regions: KVRegions,
        on_frame: Callable[[float], None] = lambda seconds: None,  # per-layer latency
        verify: bool = False,
        testing_corrupt_frame: int = 0,
    ) -> None:
        self.store = store
        self.regions = regions
        self.on_frame = on_frame
        self.verify = verify
        self.checksum_failures: dict[str, int] = {}  # by peer
        self._testing_corrupt_frame = testing_corrupt_frame
        self._data_frames = itertools.count(1)

    def receive(self, header: pb.TransferFrameHeader, fill: Fill, link: int = 0) -> None:
        """Handle one frame. Raises FrameRejected (a protocol violation: nothing written, the
        connection closes), FrameRefused (the key is not live: nothing written, the payload is
        drained, the link stays) or OSError (the entry is failed: its blocks may hold partial
        data, and its owner frees them)."""
        frame = self.open(header, link)
        if frame is None:
            return
        ok = False
        try:
            fill(frame.views, frame.deadline)
            ok = True
        finally:
            frame.close(ok)

    def open(self, header: pb.TransferFrameHeader, link: int = 0) -> OpenFrame | None:
        """Validate a frame and open its write (see `receive`); None for a FAILURE frame,
        which is handled here."""
        key = header.unique_key
        if header.kind == pb.TransferFrameHeader.FAILURE:
            if header.block_ids:  # it has no payload: bytes after it would be read as a header
                message = "a FAILURE frame names blocks"
                raise self.store.violation(key, "failure_with_blocks", message, link=link)
            logger.warning("sender failed unique key %s: %s", key, header.error)
            self.store.fail_from(key, failure_of_header(header), link)
            return None
        blocks = list(header.block_ids)
        problem = self._header_problem(header, blocks)
        if problem is not None:
            raise self.store.violation(key, *problem, link=link)
        layers = range(header.layer, header.layer + (header.layer_count or 1))
        heads = (header.head_start, header.head_count or self.regions.num_kv_heads)
        # The store counts a slice of the heads by its head count (0: all of them).
        part = 0 if heads[1] == self.regions.num_kv_heads else heads[1]
        opened: list[ReceiveEntry] = []  # the entry, once its frame is begun

        number = next(self._data_frames)

        def close(ok: bool) -> None:
            failure = None
            try:
                if ok and number == self._testing_corrupt_frame:
                    next(target())[0] ^= 0xFF
                if ok and self.verify:
                    failure = self._checksum_failure(header, target(), opened[0].peer)
                    if failure is not None:
                        raise FrameCorrupt(failure.message)
                if ok and len(self.regions.holders(*heads)) > 1:  # ranks replicating them
                    for layer in layers:
                        self.regions.mirror(layer, blocks, *heads)
            except BaseException:
                ok = False
                raise
            finally:
                if opened:
                    self.store.end_frame(opened[0], layers, len(blocks), ok, part, failure)
            if ok:
                self.on_frame(time.perf_counter() - start)

        def target() -> Iterator[memoryview]:
            return self.regions.stream_views(layers, blocks, *heads)

        start = time.perf_counter()
        try:
            opened.append(
                self.store.begin_frame(key, layers, blocks, header.block_bytes, link, part)
            )
            views = target()
        except BaseException:
            close(False)
            raise
        return OpenFrame(header, views, opened[0].deadline, close)

    def _checksum_failure(
        self, header: pb.TransferFrameHeader, views: Iterable[memoryview], peer: str
    ) -> Failure | None:
        """The failure of a frame whose bytes in decode's blocks differ from what the sender
        checksummed (naming the first such layer), or None; counted per peer."""
        got = layer_checksums(list(views), len(header.layer_checksums))
        for i, (mine, sent) in enumerate(zip(got, header.layer_checksums, strict=True)):
            if mine != sent:
                self.checksum_failures[peer] = self.checksum_failures.get(peer, 0) + 1
                layer = header.layer + i
                message = (
                    f"KV of layer {layer} from {peer or 'the prefill node'} does not match its "
                    f"checksum (xxh3-64 {mine:#018x}, sent {sent:#018x})"
                )
                logger.error("unique key %s: %s", header.unique_key, message)
                return Failure(FailureReason.KV_CORRUPT, message, "transferring", peer)
        return None

    def _header_problem(
        self, header: pb.TransferFrameHeader, blocks: list[int]
    ) -> tuple[str, str] | None:
        """(metric label, message) if the header breaks the protocol whatever its key. Checked
        first, so a refused frame's payload size is known to be sane before it is drained."""
        regions = self.regions
        heads = header.head_count or regions.num_kv_heads
        if header.head_count < 0 or regions.holder(header.head_start, heads) is None:
            message = f"heads [{header.head_start}, +{heads}) are not within one shard here"
            return "head_slice", message
        if blocks and (min(blocks) < 0 or max(blocks) >= regions.num_blocks):
            return "out_of_range_block", f"blocks {blocks[:8]} out of range"
        if len(set(blocks)) != len(blocks):
            return "duplicate_block", f"blocks {blocks[:8]} name a block twice"
        count = header.layer_count or 1
        if not (header.layer >= 0 and count > 0 and header.layer + count <= regions.num_layers):
            return "bad_layer", f"layers [{header.layer}, +{count}) out of range"
        if self.verify and len(header.layer_checksums) != count:
            message = f"{len(header.layer_checksums)} checksums for {count} layers (--kv-checksum)"
            return "checksum_missing", message
        expected = frame_block_bytes(regions, heads)
        if header.block_bytes != expected:
            message = f"block of {header.block_bytes} bytes, expected {expected}"
            return "wrong_size", message
        return None
