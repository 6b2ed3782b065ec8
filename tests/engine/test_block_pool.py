"""Block pool and per-request KV bookkeeping: plain Python, no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.engine.block_pool import (
    BlockPool,
    BlockPoolError,
    cache_keys,
    keyed_with,
    next_cache_key,
    root_key,
)
from pdserve.engine.kv_manager import KVCacheManager
from pdserve.engine.sequence import SamplingParams, Sequence


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=4))


def test_scheduler_and_block_pool_do_not_import_torch() -> None:
    code = (
        "import sys; import pdserve.engine.scheduler, pdserve.engine.block_pool, "
        "pdserve.engine.kv_manager, pdserve.engine.sequence; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cache_keys_are_chained() -> None:
    a = cache_keys(list(range(40)), 16)
    b = cache_keys(list(range(32)) + [99] * 8, 16)
    assert len(a) == 2 and a == b  # the partial third block has no key
    c = cache_keys([7] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later key
    assert len(cache_keys(list(range(40)), 16, include_partial=True)) == 3
    assert next_cache_key(0, [1, 2]) == next_cache_key(0, [1, 2])


def test_cache_keys_are_128_bit_keyed_by_the_cluster_and_salted_by_the_tenant() -> None:
    """Without the cluster's secret nobody can compute a prompt's keys offline (the KV events
    a router reads, or a guessed document, reveal nothing); 128 bits put a deliberate
    collision out of reach; a cache salt gives a tenant keys of its own."""
    tokens = list(range(32))
    plain = cache_keys(tokens, 16)
    ours, theirs = keyed_with(b"s" * 32), keyed_with(b"t" * 32)
    keyed = cache_keys(tokens, 16, key=ours)
    assert max(plain + keyed).bit_length() > 64 and all(k < 2**128 for k in plain + keyed)
    assert keyed == cache_keys(tokens, 16, key=ours)  # the same on every node of the cluster
    assert not set(keyed) & set(plain) and not set(keyed) & set(cache_keys(tokens, 16, key=theirs))
    salted = cache_keys(tokens, 16, root=root_key("tenant-a", ours), key=ours)
    other = cache_keys(tokens, 16, root=root_key("tenant-b", ours), key=ours)
    assert not set(salted) & set(keyed) and not set(salted) & set(other)
    assert root_key(None, ours) == root_key("", ours) == 0


def test_allocate_free_and_integrity() -> None:
    pool = BlockPool(8)
    kv = KVCacheManager(pool, block_size=4)
    s = seq("a", list(range(10)))  # 3 blocks
    assert kv.can_allocate(s)
    kv.allocate(s)
    assert len(s.block_table) == 3 and pool.num_free == 5
    pool.check_integrity()
    kv.free(s)
    assert pool.num_free == 8
    pool.check_integrity()


def test_can_allocate_has_no_side_effects_and_refuses_when_short() -> None:
    pool = BlockPool(2)
    kv = KVCacheManager(pool, block_size=4)
    big = seq("big", list(range(12)))
    before = (list(pool.free), list(pool.ref_counts))
    assert not kv.can_allocate(big)
    assert (list(pool.free), list(pool.ref_counts)) == before


def test_prefix_reuse_counts_and_keeps_one_token_to_compute() -> None:
    pool = BlockPool(16)
    kv = KVCacheManager(pool, block_size=4)
    first = seq("a", list(range(12)))
    kv.allocate(first)
    first.num_computed_tokens = 12
    kv.register_computed(first)
    kv.free(first)  # blocks are free but their contents stay cached
    second = seq("b", list(range(8)) + [50, 51, 52])
    kv.allocate(second)
    assert second.num_cached_tokens == 8
    assert second.block_table[:2] == first_blocks(pool, list(range(8)))
    same = seq("c", list(range(12)))  # fully cached prompt: its last block is recomputed
    kv.allocate(same)
    assert same.num_cached_tokens == 8
    pool.check_integrity()
    kv.free(second)
    kv.free(same)
    assert pool.num_free == 16
    pool.check_integrity()


def first_blocks(pool: BlockPool, tokens: list[int], block_size: int = 4) -> list[int]:
    return pool.longest_cached_prefix(cache_keys(tokens, block_size))


def test_shared_blocks_are_reference_counted() -> None:
    pool = BlockPool(16)
    kv = KVCacheManager(pool, block_size=4)
    a = seq("a", list(range(9)))
    kv.allocate(a)
    a.num_computed_tokens = 9
    kv.register_computed(a)
    b = seq("b", list(range(9)))
    kv.allocate(b)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert [pool.ref_counts[x] for x in shared] == [2, 2]
    kv.free(a)
    assert [pool.ref_counts[x] for x in shared] == [1, 1]
    kv.free(b)
    pool.check_integrity()
    assert pool.num_free == 16


def test_lru_evicts_oldest_cached_block_first() -> None:
    pool = BlockPool(3)
    kv = KVCacheManager(pool, block_size=2)
    for rid, toks in (("x", [1, 2, 9]), ("y", [3, 4, 9])):
        s = seq(rid, toks)
        kv.allocate(s)
        s.num_computed_tokens = 3
        kv.register_computed(s)
        kv.free(s)
    # Both prefixes are cached in free blocks; a 2-block request must evict one: x's (older).
    z = seq("z", [5, 6, 7])
    kv.allocate(z)
    assert first_blocks(pool, [3, 4], 2) and not first_blocks(pool, [1, 2], 2)
    pool.check_integrity()


def test_integrity_check_detects_corruption() -> None:
    pool = BlockPool(4)
    block = pool.allocate()
    pool.ref_counts[block] = 0  # corrupt: used block with no references
    with pytest.raises(BlockPoolError):
        pool.check_integrity()
    with pytest.raises(BlockPoolError):
        BlockPool(4).release(0)


def test_kv_events_follow_registration_and_eviction_and_reset_when_behind() -> None:
    from pdserve.engine.kv_events import KVEventLog

    log = KVEventLog(max_events=4)
    pool = BlockPool(3, events=log)
    keys = cache_keys(list(range(48)), 16)
    blocks = [pool.allocate() for _ in range(3)]
    for b, k in zip(blocks, keys, strict=True):
        pool.register(b, k)
    first = log.since(0)  # an unknown epoch: everything held now
    assert first.reset and sorted(first.stored) == sorted(keys)
    for b in blocks:
        pool.release(b)
    pool.allocate()  # evicts the least recently freed block's key
    changes = log.since(first.seq, first.epoch)
    assert not changes.reset and changes.stored == [] and changes.removed == [keys[0]]
    assert log.since(changes.seq, first.epoch).removed == []  # nothing new since
    for b in (pool.allocate(), pool.allocate()):  # two more evictions, then overflow the log
        pool.register(b, 1000 + b)
    behind = log.since(first.seq, first.epoch)  # its changes were dropped: a full picture
    assert behind.reset and sorted(behind.stored) == sorted(pool.cached)  # what it holds now
    assert len(pool.cached) == 2 and keys[1] not in behind.stored
    assert log.since(behind.seq, "another-epoch").reset  # a restarted node: start over


def _received(kv: KVCacheManager, tokens: list[int], window_blocks_from: int) -> Sequence:
    """A sequence whose KV came by handoff: its blocks before `window_blocks_from` hold the
    full-attention layers' KV only, registered so, then freed (their contents stay cached)."""
    s = seq("handoff", tokens)
    kv.allocate(s)
    s.window_blocks_from = window_blocks_from
    s.num_computed_tokens = len(tokens)
    kv.register_computed(s)
    kv.free(s)
    return s


def test_a_prefix_is_reused_only_as_far_as_the_window_reads_whole_blocks() -> None:
    """Window 6, blocks of 4: a query at position n reads blocks from (n - 5) // 4 on. Blocks
    0-2 of a 24-token handoff lack the windowed layers' KV."""
    pool = BlockPool(32)
    kv = KVCacheManager(pool, block_size=4, window=6)
    _received(kv, list(range(24)), window_blocks_from=3)
    assert sum(pool.partial) == 3
    # 28 tokens: 6 cached blocks; the query at 24 reads blocks 4-5, whole: all reused
    assert len(kv.cached_prefix(seq("longer", list(range(28))))) == 6
    # 17 tokens: 4 cached blocks; the query at 16 reads blocks 2-3 and block 2 is partial; at 8
    # (2 blocks) it reads block 0-1, partial too; nothing is reused
    assert kv.cached_prefix(seq("early", list(range(16)) + [99])) == []


def test_a_whole_block_takes_a_partial_ones_place_in_the_cache() -> None:
    pool = BlockPool(32)
    kv = KVCacheManager(pool, block_size=4, window=6)
    _received(kv, list(range(24)), window_blocks_from=3)
    stored = [k for k, b in pool.cached.items() if not pool.partial[b]]
    whole = seq("whole", list(range(12)) + [99])  # computed here: every layer
    kv.allocate(whole)
    assert whole.num_cached_tokens == 0
    whole.num_computed_tokens = 13
    kv.register_computed(whole)
    assert [pool.cached[k] for k in whole.block_keys] == whole.block_table[:3]
    assert not any(pool.partial[b] for b in whole.block_table)
    assert len(stored) == 3 and all(pool.cached[k] is not None for k in stored)
    pool.check_integrity()
    kv.free(whole)
    # now the query at 16 reads blocks 2-3, both whole: 4 blocks reused
    assert len(kv.cached_prefix(seq("early", list(range(16)) + [99]))) == 4
    pool.check_integrity()


def test_a_handoff_reuses_what_prefill_computes_over_and_computing_here_gives_it_back() -> None:
    """Window 6, blocks of 4, blocks 0-2 partial. A 21-token prompt sharing them whose KV
    comes by handoff keeps them (its windowed blocks would start where a query at 20, its last
    block's start, reads: block 3); the same prompt computed here after all (`compute_here`)
    keeps none: its query at 12 would read blocks 1-2, at 4 block 0."""
    pool = BlockPool(32)
    kv = KVCacheManager(pool, block_size=4, window=6)
    _received(kv, list(range(24)), window_blocks_from=3)
    partial = first_blocks(pool, list(range(12)))
    assert all(pool.partial[b] for b in partial)
    remote = seq("remote", list(range(12)) + [99] * 9)
    remote.remote_prefill = True
    kv.allocate(remote)
    assert remote.num_cached_tokens == 12 and remote.block_table[:3] == partial
    remote.window_blocks_from = 4  # as a handoff would set it
    kv.compute_here(remote)
    assert remote.num_cached_tokens == remote.num_computed_tokens == 0
    assert remote.block_keys == [] and remote.window_blocks_from == 0
    assert len(remote.block_table) == 6 and not set(remote.block_table) & set(partial)
    pool.check_integrity()
    kv.free(remote)
    assert pool.num_free == 32


# ---- window parts: a pool for a model with sliding-window layers ---------------------------


def _compute(kv: KVCacheManager, s: Sequence, n: int) -> None:
    """A step computing `n` tokens of `s` as the scheduler runs it: blocks and window parts
    for them, the tokens computed, the computed blocks registered."""
    assert kv.can_append(s, n)
    kv.append(s, n)
    s.num_computed_tokens += n
    kv.register_computed(s)
    kv.pool.check_integrity()


def _decode(kv: KVCacheManager, s: Sequence, steps: int) -> None:
    """`steps` decode steps of `s`, each sampling a token and computing it."""
    for _ in range(steps):
        s.output_token_ids.append(7)
        _compute(kv, s, 1)


def test_a_decoding_request_holds_the_window_parts_of_its_window_only() -> None:
    """Window 6, blocks of 4, 8 window parts for 32 blocks: a 14-token prompt then 56 decode
    steps hold at most the parts of the blocks a handoff of its tokens would send (the window
    of a query at its last block's start and that block on); the others are idle (cached
    whole, reusable) and go back (`on_drop`: their memory) as other blocks need parts; the
    blocks stay used (the full-attention layers)."""
    pool = BlockPool(32, window_blocks=8, window_share=0.5)
    dropped: list[int] = []
    pool.on_drop = dropped.append
    kv = KVCacheManager(pool, block_size=4, window=6)
    s = seq("long", list(range(14)))
    assert kv.can_allocate(s)
    kv.allocate(s)
    assert pool.num_windows_held == 0  # parts are taken as steps compute the blocks
    kv.append(s, 14)
    assert pool.num_windows_held == 4 and all(s.window_held)
    # the prompt computed: a query at 12 (its last block's start) reads from position 7 on
    s.num_computed_tokens = 14
    kv.register_computed(s)
    assert s.window_held == [False, True, True, True] and list(pool.idle_windows) == [
        s.block_table[0]
    ]
    _decode(kv, s, 56)
    n = s.num_computed_tokens
    last_start = (n - 1) // 4 * 4
    first = max(0, last_start - 5) // 4
    assert len(s.block_table) == 18 and pool.num_used == 18
    assert [i for i, held in enumerate(s.window_held) if held] == list(range(first, 18))
    assert pool.num_windows_held == 18 - first <= 3
    # 8 parts: the blocks behind the window that are not idle gave theirs back, oldest first
    assert pool.num_windows == 8 and list(pool.idle_windows) == s.block_table[first - 5 : first]
    assert dropped == s.block_table[: first - 5]
    assert all(pool.partial[b] for b in dropped)
    # usage in bytes: half a block's are the full layers', half its window part's
    assert pool.usage() == pytest.approx((18 + (18 - first)) / (32 + 8))
    kv.free(s)
    assert pool.num_windows_held == 0 and pool.num_free == 32
    pool.check_integrity()


def test_window_parts_bound_each_step_and_growth() -> None:
    """Window 6, blocks of 4, 4 parts for 32 blocks: a 20-token prompt is admitted, but a
    step computes only as much of it as the parts allow (4 blocks, then the rest once those
    behind its window went back); a request cannot grow into a block when no part is left,
    though blocks are, until another request frees its parts."""
    pool = BlockPool(32, window_blocks=4, window_share=0.5)
    kv = KVCacheManager(pool, block_size=4, window=6)
    a = seq("a", list(range(20)))
    assert kv.can_allocate(a)
    kv.allocate(a)
    assert kv.fit_window(a, 20) == 16
    _compute(kv, a, 16)
    # a query at 12 reads from 7 on: blocks 0 is behind; the query at 16 reads block 2 on
    assert a.window_held == [False, True, True, True, False]
    assert kv.fit_window(a, 4) == 4
    _compute(kv, a, 4)
    b = seq("b", list(range(100, 108)))
    kv.allocate(b)
    assert kv.fit_window(b, 8) == 4 and kv.can_append(b, 4)  # a holds 3 parts: 1 left
    _compute(kv, b, 4)
    assert kv.fit_window(b, 4) == 0 and not kv.can_append(b, 4)  # its 2nd block: no part
    kv.free(a)
    assert kv.can_append(b, 4)
    pool.check_integrity()


def test_a_cached_whole_prefix_keeps_its_parts_until_another_block_needs_them() -> None:
    """A finished request's blocks stay cached whole (their parts idle) and are reused whole;
    once the parts are taken for other blocks, those blocks are partial: a prompt whose
    window reads them recomputes them."""
    pool = BlockPool(16, window_blocks=4, window_share=0.5)
    kv = KVCacheManager(pool, block_size=4, window=6)
    first = seq("first", list(range(9)))
    kv.allocate(first)
    _compute(kv, first, 9)  # a query at 8 reads blocks 0-2: all kept
    kv.free(first)
    # its two full blocks cached whole, their parts idle; the third's (anonymous) went back
    assert pool.num_windows_held == 0 and len(pool.idle_windows) == 2 and pool.num_windows == 2
    again = seq("again", list(range(8)) + [50])
    assert len(kv.cached_prefix(again)) == 2
    other = seq("other", list(range(200, 216)))  # 4 blocks: takes the idle parts
    kv.allocate(other)
    kv.append(other, 16)
    assert not pool.idle_windows
    assert all(pool.partial[b] for b in first_blocks(pool, list(range(8))))
    assert kv.cached_prefix(again) == []  # its query at 8 would read the partial blocks
    pool.check_integrity()


def test_cached_parts_are_held_where_they_are_read() -> None:
    """Window 6, blocks of 4, 6 parts. A prompt's 5 blocks cached whole (parts idle). A request
    sharing them whose KV comes by handoff holds the parts of the blocks its handoff writes
    only, so another request's steps may take the cached blocks' idle parts; computed here
    after all, it reuses as much as is still whole where its first query reads, and holds
    those parts. One computed here from the start holds the parts from where a handoff of its
    cached tokens would start (`first_block_sent`)."""
    pool = BlockPool(32, window_blocks=6, window_share=0.5)
    kv = KVCacheManager(pool, block_size=4, window=6)
    first = seq("first", list(range(21)))
    kv.allocate(first)
    for n in (4, 4, 13):
        _compute(kv, first, n)
    kv.free(first)
    cached = first_blocks(pool, list(range(20)))
    assert len(cached) == 5 and set(pool.idle_windows) >= set(cached[2:])
    # 8 blocks: the handoff writes 5-7 (4 on where a migrated stream's KV comes, of all but
    # its last token: 4 is held too)
    remote = seq("remote", list(range(20)) + [77] * 9)
    remote.remote_prefill = True
    assert kv.can_allocate(remote)
    kv.allocate(remote)
    assert [i for i, h in enumerate(remote.window_held) if h] == [4, 5, 6, 7]
    other = seq("other", list(range(300, 316)))
    kv.allocate(other)
    kv.append(other, kv.fit_window(other, 16))  # the parts left: idle ones among them
    remote.remote_prefill = False
    kv.compute_here(remote)
    keep = remote.num_cached_tokens // 4
    reads = range(max(0, keep * 4 - 5) // 4, keep)
    assert all(pool.has_window[remote.block_table[i]] and remote.window_held[i] for i in reads)
    kv.free(remote)
    kv.free(other)
    again = seq("again", list(range(keep * 4)) + [78] * 9)
    kv.allocate(again)
    held = [i for i, h in enumerate(again.window_held) if h]
    assert again.num_cached_tokens == keep * 4 and held == list(
        range(max(0, keep * 4 - 4 - 5) // 4, keep)
    )
    pool.check_integrity()
