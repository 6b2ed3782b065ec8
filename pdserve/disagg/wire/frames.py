"""The transfer plane's messages, built and read here only: a frame's header (a layer's blocks
for a key, or the failure of a key), and NIXL's notifications (a frame naming the source blocks
to read, the acknowledgements, and what a peer publishes of its KV memory)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.engine.failure import Failure

if TYPE_CHECKING:
    from pdserve.disagg.transport.base import LayerWrite
    from pdserve.disagg.transport.regions import KVRegions

__all__ = [
    "data_header",
    "failure_header",
    "frame_block_bytes",
    "nixl_ack",
    "nixl_acks",
    "nixl_frame",
    "nixl_peer",
    "nixl_shard",
]


def frame_block_bytes(regions: KVRegions, head_count: int) -> int:
    """Bytes per block of a frame carrying `head_count` heads (0: all)."""
    return regions.head_bytes * (head_count or regions.num_kv_heads)


def data_header(
    write: LayerWrite, regions: KVRegions, layers: int = 1, checksums: Sequence[int] = ()
) -> pb.TransferFrameHeader:
    """The header of `write`'s frame, carrying `layers` consecutive layers from its own (and
    each layer's checksum, with --kv-checksum)."""
    return pb.TransferFrameHeader(
        kind=pb.TransferFrameHeader.DATA,
        unique_key=write.unique_key,
        layer=write.layer,
        block_ids=write.dst_blocks,
        head_start=write.head_start,
        head_count=write.head_count or regions.num_kv_heads,
        block_bytes=frame_block_bytes(regions, write.head_count),
        layer_count=layers if layers > 1 else 0,
        layer_checksums=checksums,
    )


def failure_header(unique_key: str, failure: Failure) -> pb.TransferFrameHeader:
    return pb.TransferFrameHeader(
        kind=pb.TransferFrameHeader.FAILURE,
        unique_key=unique_key,
        error=failure.message,
        reason=failure.reason.value,
        stage=failure.stage,
    )


# ---- NIXL -----------------------------------------------------------------------------------


def nixl_frame(header: pb.TransferFrameHeader, src_blocks: Sequence[int] = ()) -> bytes:
    """A notification asking decode to read `src_blocks` (none: a failure frame)."""
    frame: bytes = pb.NixlFrame(header=header, src_block_ids=src_blocks).SerializeToString()
    return frame


def nixl_ack(header: pb.TransferFrameHeader, refused: str = "", message: str = "") -> pb.NixlAck:
    return pb.NixlAck(
        unique_key=header.unique_key,
        layer=header.layer,
        head_start=header.head_start,
        refused=refused,
        message=message,
    )


def nixl_acks() -> pb.NixlAcks:
    """An empty batch of acknowledgements, to append to."""
    return pb.NixlAcks()


def nixl_shard(
    head_start: int, num_heads: int, layer_addresses: Sequence[int], block_bytes: int
) -> pb.NixlShard:
    """Where one tensor-parallel rank's heads of every layer lie in its peer's memory."""
    return pb.NixlShard(
        head_start=head_start,
        num_heads=num_heads,
        layer_addresses=layer_addresses,
        block_bytes=block_bytes,
    )


def nixl_peer(
    agent_metadata: bytes,
    layer_addresses: Sequence[int],
    num_blocks: int,
    block_bytes: int,
    shards: list[pb.NixlShard],
) -> bytes:
    """What a decode needs to read a prefill's KV (a serialized NixlPeer)."""
    info: bytes = pb.NixlPeer(
        agent_metadata=agent_metadata,
        layer_addresses=layer_addresses,
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        shards=shards,
    ).SerializeToString()
    return info
