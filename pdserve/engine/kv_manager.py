"""Per-request use of the block pool: admission with prefix reuse, growing a request's block
table as it is computed, registering computed blocks for reuse, and freeing. No torch.

Every query (`can_allocate`, `can_append`, `cached_prefix`) is free of side effects; the
matching action (`allocate`, `append`) is called only after its query said yes.
"""

from __future__ import annotations

from pdserve.engine.block_pool import BlockPool, cache_keys, next_cache_key, root_key
from pdserve.engine.sequence import Sequence


class KVCacheManager:
    """`hash_key`: what the cluster's cache keys are keyed with (`block_pool.keyed_with`)."""

    def __init__(self, pool: BlockPool, block_size: int, hash_key: bytes = b"") -> None:
        self.pool = pool
        self.block_size = block_size
        self.hash_key = hash_key

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
        return self.pool.longest_cached_prefix(self.keys(seq, tokens))

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
            self.pool.register(seq.block_table[i], parent)

    def free(self, seq: Sequence) -> None:
        # Release the tail first so that a prefix's first blocks are the last ones evicted.
        for block in reversed(seq.block_table):
            self.pool.release(block)
        seq.block_table = []
        seq.block_keys = []
        seq.num_computed_tokens = 0
