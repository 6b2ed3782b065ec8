"""Decode side of a transfer: validates each frame against the resource store and lets the
transport write the bytes straight into the target blocks (never into a staging buffer).

A frame is accepted only if its header keeps the protocol (layer and blocks in range, no
block twice, exact sizes), its key is registered and live and every block one of that entry's
targets. A protocol violation closes the connection; a frame for a key that is not live
(unknown, cancelled, failed, expired) is refused alone and the link stays up. Nothing is
written either way, and every rejection is counted. A FAILURE frame fails the entry with the
reason prefill sent; it carries no payload, so one that names blocks is a violation. A key's
frames (FAILURE included) are bound to the connection that sent its first one: a frame for it
on another connection is refused and touches nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.resource_store import ResourceStore
from pdserve.disagg.transport.base import Fill, KVRegions
from pdserve.disagg.wire import failure_of_header

logger = logging.getLogger(__name__)


class KVReceiver:
    def __init__(
        self,
        store: ResourceStore,
        regions: KVRegions,
        on_frame: Callable[[float], None] = lambda seconds: None,  # per-layer latency
    ) -> None:
        self.store = store
        self.regions = regions
        self.on_frame = on_frame

    def receive(self, header: pb.TransferFrameHeader, fill: Fill, link: int = 0) -> None:
        """Handle one frame. Raises FrameRejected (a protocol violation: nothing written, the
        connection closes), FrameRefused (the key is not live: nothing written, the payload is
        drained, the link stays) or OSError (the entry is failed: its blocks may hold partial
        data, and its owner frees them)."""
        key = header.unique_key
        if header.kind == pb.TransferFrameHeader.FAILURE:
            if header.block_ids:  # it has no payload: bytes after it would be read as a header
                message = "a FAILURE frame names blocks"
                raise self.store.violation(key, "failure_with_blocks", message, link=link)
            logger.warning("sender failed unique key %s: %s", key, header.error)
            self.store.fail_from(key, failure_of_header(header), link)
            return
        problem = self._header_problem(header)
        if problem is not None:
            raise self.store.violation(key, *problem, link=link)
        blocks = list(header.block_ids)
        entry = self.store.begin_frame(key, header.layer, blocks, header.block_bytes, link)
        ok = False
        start = time.perf_counter()
        try:
            fill(self.regions.views(header.layer, blocks), entry.deadline)
            ok = True
        finally:
            self.store.end_frame(entry, header.layer, len(blocks), ok)
        self.on_frame(time.perf_counter() - start)

    def _header_problem(self, header: pb.TransferFrameHeader) -> tuple[str, str] | None:
        """(metric label, message) if the header breaks the protocol whatever its key. Checked
        first, so a refused frame's payload size is known to be sane before it is drained."""
        regions, blocks = self.regions, list(header.block_ids)
        if header.head_start != 0 or header.head_count not in (0, regions.num_kv_heads):
            return "head_slice", f"heads [{header.head_start}, +{header.head_count}) not supported"
        if any(not 0 <= b < regions.num_blocks for b in blocks):
            return "out_of_range_block", f"blocks {blocks[:8]} out of range"
        if len(set(blocks)) != len(blocks):
            return "duplicate_block", f"blocks {blocks[:8]} name a block twice"
        if not 0 <= header.layer < regions.num_layers:
            return "bad_layer", f"layer {header.layer} out of range"
        if header.block_bytes != regions.block_bytes:
            message = f"block of {header.block_bytes} bytes, expected {regions.block_bytes}"
            return "wrong_size", message
        return None
