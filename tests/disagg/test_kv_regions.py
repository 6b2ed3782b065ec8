"""KV regions of a tensor-parallel node: the byte views of a frame's head slice are exactly
those heads' K then V per block (checked against torch slicing of the unsharded cache), frames
are cut wherever either side's ranks split the heads and cover every head once, heads written
into their first holder are copied to the ranks that replicate them, and decode refuses a
prefill whose reported ranks do not hold every head."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.transport.nixl_agent import slice_descs
from pdserve.disagg.transport.regions import KVRegions, pair_runs, runs
from pdserve.disagg.wire import head_bounds_problem, kv_ranks_problem
from pdserve.engine.kv_cache import KVShard

BLOCKS, HEADS, BLOCK, DIM, LAYERS = 12, 4, 4, 8, 2


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30))
def test_pair_runs_cover_the_pairs_in_order_in_maximal_runs(pairs: list[tuple[int, int]]) -> None:
    src, dst = [s for s, _ in pairs], [d for _, d in pairs]
    got = pair_runs(src, dst)
    expanded = [(s + i, d + i) for s, d, n in got for i in range(n)]
    assert expanded == pairs  # every pair, in order, nothing else
    for (s, d, n), (s2, d2, _) in zip(got, got[1:], strict=False):
        assert (s2, d2) != (s + n, d + n)  # no two neighbours could have been one run
    assert runs(src) == [(s, n) for s, _, n in pair_runs(src, src)]


def full_cache(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, 2, HEADS, BLOCK, DIM, generator=g) for _ in range(LAYERS)]


def sharded(caches: list[torch.Tensor], ranges: list[tuple[int, int]]) -> KVRegions:
    """Regions whose shards hold copies of `caches`' heads [start, start + count)."""
    shards = [
        KVShard(start, [c[:, :, start : start + count].contiguous() for c in caches])
        for start, count in ranges
    ]
    return KVRegions.sharded(shards)


def joined(views: list[memoryview]) -> bytes:
    return b"".join(bytes(v) for v in views)


def expected(cache: torch.Tensor, blocks: list[int], start: int, count: int) -> bytes:
    """A frame's payload by definition: per block, K of the heads, then V."""
    parts = [cache[b, kv, start : start + count].contiguous() for b in blocks for kv in (0, 1)]
    return b"".join(p.numpy().tobytes() for p in parts)


@pytest.mark.parametrize(
    "ranges",
    [[(0, 4)], [(0, 2), (2, 2)], [(0, 1), (1, 1), (2, 1), (3, 1)]],
    ids=["tp1", "tp2", "tp4"],
)
@pytest.mark.parametrize("peer_bounds", [[0, 4], [0, 2, 4], [0, 1, 2, 3, 4]], ids=str)
def test_frames_cover_every_head_once_with_the_right_bytes(
    ranges: list[tuple[int, int]], peer_bounds: list[int]
) -> None:
    caches = full_cache(0)
    regions = sharded(caches, ranges)
    frames = regions.frame_heads(peer_bounds)
    covered = [h for start, count in frames for h in range(start, start + count)]
    assert covered == list(range(HEADS))  # each head once, in order
    blocks = [7, 8, 9, 2, 5]  # a run and scattered ids
    for start, count in frames:
        assert regions.holder(start, count) is not None  # within one of our shards
        peer = zip(peer_bounds, peer_bounds[1:], strict=False)
        assert any(a <= start and start + count <= b for a, b in peer)  # within one of theirs
        for layer in range(LAYERS):
            views = regions.views(layer, blocks, start, count)
            assert joined(views) == expected(caches[layer], blocks, start, count)


def test_writing_a_slice_lands_in_its_rank_and_is_mirrored_to_replicas() -> None:
    """Two KV heads over four ranks (each head on two ranks): bytes received into the first
    holder of head 1 reach the other rank holding it, and nothing else changes."""
    zeros = [torch.zeros(BLOCKS, 2, 2, BLOCK, DIM) for _ in range(LAYERS)]
    regions = sharded(zeros, [(0, 1), (0, 1), (1, 1), (1, 1)])
    source = full_cache(1)
    blocks = [3, 4, 10]
    payload = np.frombuffer(expected(source[1], blocks, 1, 1), dtype=np.uint8)
    offset = 0
    for view in regions.views(1, blocks, 1, 1):  # what a receiver's fill does
        target = np.frombuffer(view, dtype=np.uint8)
        target[:] = payload[offset : offset + len(target)]
        offset += len(target)
    regions.mirror(1, blocks, 1, 1)
    for shard in regions.shards[2:]:  # both holders of head 1
        torch.testing.assert_close(shard.caches[1][blocks, :, 0], source[1][blocks, :, 1])
        untouched = [b for b in range(BLOCKS) if b not in blocks]
        assert not shard.caches[1][untouched].any() and not shard.caches[0].any()
    assert all(not c.any() for s in regions.shards[:2] for c in s.caches)  # head 0's ranks


def test_heads_outside_one_shard_are_not_addressable() -> None:
    regions = sharded(full_cache(2), [(0, 2), (2, 2)])
    assert regions.holder(1, 2) is None  # straddles two ranks
    with pytest.raises(ValueError, match="no shard holds heads"):
        regions.views(0, [1], 1, 2)


def test_streamed_views_are_the_listed_ones_and_a_bad_layer_fails_before_any_is_made() -> None:
    """A frame's views made as a socket reads them are the very views listed at once; a layer
    out of range (or negative, which a list would read from its end) fails when the stream is
    asked for, not halfway through a frame on the wire."""
    regions = sharded(full_cache(3), [(0, 2), (2, 2)])
    for heads in ((0, 2), (2, 1)):
        streamed = [bytes(v) for v in regions.stream_views([0, 1], [5, 2, 3], *heads)]
        assert streamed == [bytes(v) for v in regions.layers_views([0, 1], [5, 2, 3], *heads)]
    for layers in ([0, LAYERS], [-1]):
        with pytest.raises(IndexError, match="out of range"):
            regions.stream_views(layers, [1], 0, 2)


def ranks(tp: int, *ranges: tuple[int, int]) -> pb.PeerInfo:
    kv = [pb.KVRank(rank=r, head_start=a, head_count=n) for r, (a, n) in enumerate(ranges)]
    return pb.PeerInfo(tp_size=tp, kv_ranks=kv)


def test_decode_refuses_a_prefill_whose_ranks_do_not_hold_every_head() -> None:
    assert kv_ranks_problem(pb.PeerInfo(tp_size=1), 4) is None  # one rank, every head
    assert kv_ranks_problem(ranks(2, (0, 2), (2, 2)), 4) is None
    assert kv_ranks_problem(ranks(4, (0, 1), (0, 1), (1, 1), (1, 1)), 2) is None  # replicated
    assert "not all 4" in str(kv_ranks_problem(ranks(2, (0, 2), (0, 2)), 4))
    assert "[2, 6) of 4" in str(kv_ranks_problem(ranks(2, (0, 2), (2, 4)), 4))
    assert "size 3 with 2 ranks" in str(kv_ranks_problem(ranks(3, (0, 2), (2, 2)), 4))


def test_nixl_slice_descriptors_address_exactly_the_views_of_the_slice() -> None:
    """What NIXL reads or writes for a head slice is the memory the TCP path would scatter
    into: the same (address, length) pairs, K then V per block."""
    regions = sharded(full_cache(3), [(0, 2), (2, 2)])
    blocks = [5, 6, 1]
    for first, count in [(2, 1), (3, 1), (2, 2)]:
        index = regions.holder(first, count)
        assert index is not None
        shard = regions.shards[index]
        if count == shard.num_heads:
            continue  # whole blocks: run_descs' territory
        layer = 1
        descs = slice_descs(
            shard.caches[layer].data_ptr(),
            blocks,
            shard.num_heads,
            first - shard.head_start,
            count,
            regions.head_bytes,
        )
        views = regions.views(layer, blocks, first, count)
        addresses = [np.frombuffer(v, dtype=np.uint8).ctypes.data for v in views]
        assert descs[:, 0].tolist() == addresses
        assert descs[:, 1].tolist() == [len(v) for v in views]


def test_prefill_refuses_head_bounds_that_do_not_split_the_heads() -> None:
    assert head_bounds_problem([0, 4], 4) is None
    assert head_bounds_problem([0, 1, 2, 3, 4], 4) is None
    for bad in ([1, 4], [0, 3], [0, 2, 2, 4], [0, 3, 2, 4], [0, 8], [-1, 4]):
        assert "do not split 4 KV heads" in str(head_bounds_problem(bad, 4)), bad
