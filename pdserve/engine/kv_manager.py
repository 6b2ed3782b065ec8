"""Per-request use of the block pool: admission with prefix reuse, growing a request's block
table as it is computed, registering computed blocks for reuse, and freeing. No torch.

Every query (`can_allocate`, `can_append`, `cached_prefix`) is free of side effects; the
matching action (`allocate`, `append`) is called only after its query said yes.

Models with sliding-window layers: a handoff brings a windowed layer only the blocks its
window still reads, so a prompt's earlier blocks may hold the full-attention layers' KV alone
(registered as partial). A cached prefix is reused only as far as the blocks read by the window
of the first query computed here are whole: for a request whose prompt is computed here, the
query right after the prefix; for one whose KV comes by handoff, a query at the start of its
last block, where the handoff's windowed blocks start (the prefill node computes the rest from
its own cache). A request that was to come by
handoff and is computed here after all gives back what its own window cannot use
(`compute_here`).
"""

from __future__ import annotations

from pdserve.engine.block_pool import BlockPool, cache_keys, next_cache_key, root_key
from pdserve.engine.sequence import Sequence


def first_block_seen(window: int | None, num_tokens: int, block_size: int) -> int:
    """The first of a sequence's blocks that a layer with this sliding window still reads once
    `num_tokens` tokens are in the cache (the next query, at position num_tokens, sees
    [num_tokens - window + 1, num_tokens]): the blocks before it are neither sent nor needed.
    0 for full attention."""
    if window is None:
        return 0
    return max(0, num_tokens - window + 1) // block_size


def first_block_sent(window: int | None, num_tokens: int, block_size: int) -> int:
    """The first block of a layer with this sliding window that a handoff of `num_tokens`
    tokens' KV carries: what the window of a query at the start of their last block reads,
    where a request with the same tokens (a sibling of `n > 1`, the same prompt again) computes
    on decode over them; decode's own next query, at num_tokens, reads no earlier block."""
    if not num_tokens:
        return 0
    last_start = (num_tokens - 1) // block_size * block_size
    return first_block_seen(window, last_start, block_size)


class KVCacheManager:
    """`hash_key`: what the cluster's cache keys are keyed with (`block_pool.keyed_with`);
    `window`: the model's widest sliding window (None: no windowed layers)."""

    def __init__(
        self, pool: BlockPool, block_size: int, hash_key: bytes = b"", window: int | None = None
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.hash_key = hash_key
        self.window = window

    def keys(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Cache keys of `tokens`' full blocks, from `seq`'s cache salt."""
        return cache_keys(tokens, self.block_size, root=self._root(seq), key=self.hash_key)

    def _root(self, seq: Sequence) -> int:
        return root_key(seq.options.cache_salt, self.hash_key)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks reusable for `seq`. At least one token is always left to compute,
        because the next token is sampled from the last prompt token's logits."""
        reusable = (seq.num_tokens - 1) // self.block_size
        tokens = seq.all_token_ids[: reusable * self.block_size]
        hits = self.pool.longest_cached_prefix(self.keys(seq, tokens))
        # by handoff: whole from where the handoff's windowed blocks start (first_block_sent)
        last_start = (seq.num_tokens - 1) // self.block_size * self.block_size
        here_from = last_start if seq.remote_prefill else None
        return hits[: self._whole_window(hits, here_from)]

    def _whole_window(self, hits: list[int], here_from: int | None = None) -> int:
        """How many of `hits` can be reused: as many as leave no partial block among those read
        by the window of the first query computed here, at `here_from` (None: right after the
        reused blocks)."""
        n = len(hits)
        while n and self.window is not None:
            at = n * self.block_size if here_from is None else here_from
            first = first_block_seen(self.window, at, self.block_size)
            partial = next((j for j in range(first, n) if self.pool.partial[hits[j]]), None)
            if partial is None:
                break
            n = partial  # every longer prefix still reads it
        return n

    def compute_here(self, seq: Sequence) -> None:
        """`seq` was allocated to get its KV by handoff and computes it here instead: of its
        cached blocks it keeps those its own window can use; the rest are swapped for fresh
        ones and computed again (the same number of blocks: always possible)."""
        seq.window_blocks_from = 0
        cached = seq.num_cached_tokens // self.block_size
        keep = self._whole_window(seq.block_table[:cached])
        if keep == cached:
            return
        for i in range(keep, cached):
            self.pool.release(seq.block_table[i])
            seq.block_table[i] = self.pool.allocate()
        seq.num_cached_tokens = seq.num_computed_tokens = keep * self.block_size
        del seq.block_keys[keep:]

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self.cached_prefix(seq)
        needed = self.blocks_for(seq.num_tokens) - len(hits)
        return self.pool.num_free - self.pool.num_reclaimable(hits) >= needed

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all of `seq`'s current tokens; a cached prefix is reused, not recomputed."""
        assert not seq.block_table, f"request {seq.request_id} already holds blocks"
        hits = self.cached_prefix(seq)
        for block in hits:
            self.pool.take_cached(block)
        fresh = [self.pool.allocate() for _ in range(self.blocks_for(seq.num_tokens) - len(hits))]
        seq.block_table = hits + fresh
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        seq.block_keys = self.keys(seq, seq.all_token_ids[: seq.num_cached_tokens])

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.pool.num_free

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        seq.block_table.extend(self.pool.allocate() for _ in range(max(0, needed)))

    def register_computed(self, seq: Sequence) -> None:
        """Register cache keys for blocks that became full and computed since the last call."""
        full = seq.num_computed_tokens // self.block_size
        parent = seq.block_keys[-1] if seq.block_keys else self._root(seq)
        for i in range(len(seq.block_keys), full):
            tokens = [
                seq.token_at(j) for j in range(i * self.block_size, (i + 1) * self.block_size)
            ]
            parent = next_cache_key(parent, tokens, self.hash_key)
            seq.block_keys.append(parent)
            self.pool.register(seq.block_table[i], parent, i < seq.window_blocks_from)

    def free(self, seq: Sequence) -> None:
        # Release the tail first so that a prefix's first blocks are the last ones evicted.
        for block in reversed(seq.block_table):
            self.pool.release(block)
        seq.block_table = []
        seq.block_keys = []
        seq.num_computed_tokens = 0
        seq.window_blocks_from = 0
