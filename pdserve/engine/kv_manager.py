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

A pool with window parts (`BlockPool.window_blocks`): a request holds the window part of each
block its window may still read (`Sequence.window_held`) and lets go of those behind it as it
advances (`register_computed`): behind `first_block_sent` of its computed tokens, so that
what a handoff or a live migration of them sends is still there.
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
        ones and computed again (the same number of blocks: always possible; their window
        parts are taken as each step computes them, `append`)."""
        seq.window_blocks_from = 0
        cached = seq.num_cached_tokens // self.block_size
        keep = self._whole_window(seq.block_table[:cached])
        for i in range(keep, cached):
            self.pool.release(seq.block_table[i], seq.window_held[i])
            seq.block_table[i] = self.pool.allocate(window=False)
            seq.window_held[i] = False
        seq.num_cached_tokens = seq.num_computed_tokens = keep * self.block_size
        del seq.block_keys[keep:]
        if self.window is not None and self.pool.windowed:
            # the kept blocks its first query reads are whole now: held, they stay so
            first = first_block_seen(self.window, keep * self.block_size, self.block_size)
            self._hold_windows(seq, range(first, keep))

    def _window_span(self, seq: Sequence, start: int, end: int) -> range:
        """The blocks whose window parts computing tokens [start, end) of `seq` needs: those
        the window of the query at `start` reads on, to the last one written. A request
        whose KV comes by handoff: those the handoff writes (`first_block_sent`, of every
        token, or of all but the last where a migrated stream's KV comes)."""
        if self.window is None or not self.pool.windowed:
            return range(0)
        if seq.remote_prefill:
            first = first_block_sent(self.window, seq.num_tokens - 1, self.block_size)
            return range(first, self.blocks_for(seq.num_tokens))
        return range(first_block_seen(self.window, start, self.block_size), self.blocks_for(end))

    def _windows_to_take(self, seq: Sequence, span: range) -> int:
        """Window parts holding `span` of `seq`'s blocks takes from those available: one for
        each block without a part or with an idle one (the blocks not yet allocated too)."""
        have = len(seq.block_table)
        return sum(
            1
            for i in span
            if i >= have
            or (not seq.window_held[i] and self.pool.windows_needed([seq.block_table[i]]))
        )

    def _hold_windows(self, seq: Sequence, span: range) -> None:
        for i in span:
            if not seq.window_held[i]:
                self.pool.hold_window(seq.block_table[i])
                seq.window_held[i] = True

    def _parts_kept(self, seq: Sequence, start: int) -> range:
        """Of `seq`'s blocks, those whose window parts it holds from admission, `start`
        tokens cached: the handoff's, or those the first query computed here reads on."""
        if self.window is None or not self.pool.windowed:
            return range(0)
        if seq.remote_prefill:
            return self._window_span(seq, start, start + 1)
        return range(first_block_sent(self.window, start, self.block_size), 1 << 62)

    def can_allocate(self, seq: Sequence) -> bool:
        """Blocks for `seq`, and window parts: of the blocks its handoff writes, or of those a
        first step of one token computes here reads (a step then takes what more fit:
        `fit_window`)."""
        hits = self.cached_prefix(seq)
        needed = self.blocks_for(seq.num_tokens) - len(hits)
        if self.pool.num_free - self.pool.num_reclaimable(hits) < needed:
            return False
        if self.window is None or not self.pool.windowed:
            return True
        start = len(hits) * self.block_size
        kept, span = self._parts_kept(seq, start), self._window_span(seq, start, start + 1)
        windows = sum(
            1
            for i, block in enumerate(hits)
            if i in kept and (block in self.pool.idle_windows or not self.pool.has_window[block])
        )
        windows += len([i for i in span if i >= len(hits)])
        return windows <= self.pool.num_windows_available

    def fit_window(self, seq: Sequence, num_new_tokens: int) -> int:
        """How many of `num_new_tokens` tokens `seq` can compute next with the window parts
        available now (blocks are checked by `can_append`)."""
        if self.window is None or not self.pool.windowed or seq.remote_prefill:
            return num_new_tokens
        start = seq.num_computed_tokens
        span = self._window_span(seq, start, start + num_new_tokens)
        left = self.pool.num_windows_available
        for i in span:
            left -= self._windows_to_take(seq, range(i, i + 1))
            if left < 0:
                return max(0, min(num_new_tokens, i * self.block_size - start))
        return num_new_tokens

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all of `seq`'s current tokens; a cached prefix is reused, not recomputed.
        A handoff's blocks get their window parts now; a prompt computed here, step by step."""
        assert not seq.block_table, f"request {seq.request_id} already holds blocks"
        hits = self.cached_prefix(seq)
        start = len(hits) * self.block_size
        kept = self._parts_kept(seq, start)
        held = [self.pool.take_cached(block, i in kept) for i, block in enumerate(hits)]
        fresh = self.blocks_for(seq.num_tokens) - len(hits)
        seq.block_table = hits + [self.pool.allocate(window=False) for _ in range(fresh)]
        seq.window_held = held + [False] * fresh
        seq.window_kept_from = 0
        seq.num_cached_tokens = seq.num_computed_tokens = start
        seq.block_keys = self.keys(seq, seq.all_token_ids[:start])
        if seq.remote_prefill:
            self._hold_windows(seq, self._window_span(seq, start, seq.num_tokens))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `seq` can compute `num_new_tokens` more: blocks and window parts."""
        end = seq.num_computed_tokens + num_new_tokens
        needed = self.blocks_for(end) - len(seq.block_table)
        if needed > self.pool.num_free:
            return False
        span = self._window_span(seq, seq.num_computed_tokens, end)
        return self._windows_to_take(seq, span) <= self.pool.num_windows_available

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        end = seq.num_computed_tokens + num_new_tokens
        for _ in range(max(0, self.blocks_for(end) - len(seq.block_table))):
            seq.block_table.append(self.pool.allocate(window=False))
            seq.window_held.append(False)
        self._hold_windows(seq, self._window_span(seq, seq.num_computed_tokens, end))

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
        self._leave_behind(seq)

    def _leave_behind(self, seq: Sequence) -> None:
        """Give back the window parts of `seq`'s blocks behind its window (those a handoff
        of its computed tokens would not send)."""
        if self.window is None or not self.pool.windowed:
            return
        behind = first_block_sent(self.window, seq.num_computed_tokens, self.block_size)
        for i in range(seq.window_kept_from, min(behind, len(seq.block_table))):
            if seq.window_held[i]:
                seq.window_held[i] = False
                self.pool.drop_window(seq.block_table[i])
        seq.window_kept_from = max(seq.window_kept_from, behind)

    def free(self, seq: Sequence) -> None:
        # Release the tail first so that a prefix's first blocks are the last ones evicted.
        for block, held in zip(reversed(seq.block_table), reversed(seq.window_held), strict=True):
            self.pool.release(block, held)
        seq.block_table = []
        seq.window_held = []
        seq.window_kept_from = 0
        seq.block_keys = []
        seq.num_computed_tokens = 0
        seq.window_blocks_from = 0
