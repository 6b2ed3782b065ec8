"""The transport interface, shaped like RDMA: memory regions are registered once; a write is a
list of (local blocks -> remote blocks) for one (request, layer) with a completion callback;
the receiving side learns of completed writes (here through the KV receiver's store).

A frame on a byte stream is: 4-byte big-endian header length, a TransferFrameHeader, then
`len(block_ids) * block_bytes` raw bytes (the blocks, in order).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.engine.events import AsyncEvent, CompletedEvent

HEADER_LEN = struct.Struct(">I")
MAX_HEADER_BYTES = 1 << 20

Completion = Callable[[Exception | None], None]


class TransportError(RuntimeError):
    """A write could not be delivered; names the peer, the unique key and the stage."""


class KVRegions:
    """Registered KV memory: per layer a byte view [num_blocks, block_bytes] of the cache tensor
    (each block one contiguous range, DESIGN.md §5). No copies: views of the live tensors."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.layers: list[np.ndarray] = [
            c.view(torch.uint8).reshape(c.shape[0], -1).numpy() for c in caches
        ]
        self.num_layers = len(caches)
        self.num_blocks = caches[0].shape[0] if caches else 0
        self.block_bytes = self.layers[0].shape[1] if caches else 0
        self.num_kv_heads = caches[0].shape[2] if caches else 0
        # One flat byte view per layer; a block range is a cheap slice of it.
        self._flat = [memoryview(a).cast("B") for a in self.layers]  # type: ignore[arg-type]

    def views(self, layer: int, blocks: list[int]) -> list[memoryview]:
        """Byte views covering `blocks` in order, one per run of consecutive block ids."""
        flat, size = self._flat[layer], self.block_bytes
        return [flat[start * size : (start + length) * size] for start, length in runs(blocks)]


def runs(blocks: list[int]) -> list[tuple[int, int]]:
    """[(first, count)] for runs of consecutive ids: 3,4,5,9 -> (3,3),(9,1)."""
    out: list[tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
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


class TransferSender:
    """Delivers LayerWrites; `done(None)` once the bytes left this node's block memory (the
    blocks may then be freed), `done(error)` otherwise. Writes to one peer keep their order."""

    regions: KVRegions  # the registered source memory
    # Fault injection for tests: a pause before each write, as on a slow network.
    testing_delay_s: float = 0.0

    def submit(self, write: LayerWrite) -> None:
        raise NotImplementedError

    def send_failure(self, peer: str, unique_key: str, error: str) -> None:
        """Tell the receiver this key will get no more data (best effort)."""

    def cancel(self, unique_key: str) -> None:
        """Complete this key's queued writes with an error without sending them."""

    def forget(self, unique_key: str) -> None:
        """Every write of this key has completed: drop what `cancel` remembered."""

    def close(self) -> None:
        raise NotImplementedError

    @property
    def bytes_sent(self) -> int:
        return 0
