"""Decode side of a transfer: validates each frame against the resource store and lets the
transport write the bytes straight into the target blocks (never into a staging buffer).

A frame is accepted only if its key is registered and live, its layer in range, every block
one of that entry's targets and its sizes exact; otherwise nothing is written, the rejection
is counted and the transport closes the connection. A FAILURE frame fails the entry with the
reason prefill sent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.resource_store import ResourceStore
from pdserve.disagg.transport.base import Fill, FrameRejected, KVRegions
from pdserve.disagg.wire import failure_of_header
from pdserve.engine.failure import Failure, FailureReason

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

    def receive(self, header: pb.TransferFrameHeader, fill: Fill) -> None:
        """Handle one frame. Raises FrameRejected (nothing written) or OSError (the entry is
        failed: its blocks may hold partial data, and its owner frees them)."""
        if header.kind == pb.TransferFrameHeader.FAILURE:
            logger.warning("sender failed unique key %s: %s", header.unique_key, header.error)
            self.store.fail(header.unique_key, failure_of_header(header))
            return
        blocks = list(header.block_ids)
        if header.head_start != 0 or header.head_count not in (0, self.regions.num_kv_heads):
            raise FrameRejected(
                "head_slice", f"heads [{header.head_start}, +{header.head_count}) not supported"
            )
        if any(not 0 <= b < self.regions.num_blocks for b in blocks):
            failure = Failure(
                FailureReason.TRANSFER_FAILED, "frame names a block outside the cache"
            )
            self.store.fail(header.unique_key, failure)
            raise self.store.reject("out_of_range_block", f"blocks {blocks} out of range")
        if not 0 <= header.layer < self.regions.num_layers:
            raise self.store.reject("bad_layer", f"layer {header.layer} out of range")
        entry = self.store.begin_frame(header.unique_key, header.layer, blocks, header.block_bytes)
        ok = False
        start = time.perf_counter()
        try:
            fill(self.regions.views(header.layer, blocks))
            ok = True
        finally:
            self.store.end_frame(entry, header.layer, len(blocks), ok)
        self.on_frame(time.perf_counter() - start)
