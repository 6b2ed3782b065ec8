"""The KV block pool: reference-counted blocks, chained cache keys for prefix caching, and an
LRU of free blocks whose contents stay reusable until evicted. Plain Python, no torch.

A block is in exactly one of two states: used (ref_count > 0) or free (ref_count == 0, in the
LRU). A free block that still holds a registered cache key can be taken back by a request with
the same prefix; allocating a fresh block evicts the least recently freed one and its key.
"""

from __future__ import annotations

import hashlib
import hmac
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from pdserve.engine.kv_events import KVEventLog

ROOT_KEY = 0  # the parent of a prompt's first block (without a cache salt)
# 128-bit keys: a deliberate collision (a hit on another prompt's KV) is out of reach.
KEY_BYTES = 16


class BlockPoolError(RuntimeError):
    """The pool's bookkeeping is inconsistent, or a request asked for more than it holds."""


def keyed_with(secret: bytes) -> bytes:
    """The hash key of a cluster's cache keys, derived from its secret (the router computes
    the same): without the secret, nobody can tell offline which prompt has which keys."""
    return hmac.new(secret, b"pdserve prefix cache keys", hashlib.sha256).digest()


def next_cache_key(parent: int, token_ids: Sequence[int], key: bytes = b"") -> int:
    """Key of a block of tokens given its parent block's key (`root_key` for the first block),
    a 128-bit BLAKE2b keyed with `key` (the cluster's, or none). Stable across processes and
    machines: the same prefix gets the same keys on every node of a cluster."""
    h = hashlib.blake2b(parent.to_bytes(KEY_BYTES, "little"), digest_size=KEY_BYTES, key=key)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def root_key(salt: str | None, key: bytes = b"") -> int:
    """The parent of a prompt's first block: ROOT_KEY, or one of the request's cache salt, so
    requests share cached blocks only with requests of the same salt (vLLM's `cache_salt`)."""
    if not salt:
        return ROOT_KEY
    h = hashlib.blake2b(b"cache_salt\0" + salt.encode(), digest_size=KEY_BYTES, key=key)
    return int.from_bytes(h.digest(), "little")


def cache_keys(
    token_ids: Sequence[int],
    block_size: int,
    include_partial: bool = False,
    root: int = ROOT_KEY,
    key: bytes = b"",
) -> list[int]:
    """Chained keys of every full block of `token_ids` (and of the last partial one if asked),
    from `root` (see `root_key`) under the hash key `key`."""
    keys: list[int] = []
    parent = root
    end = len(token_ids) if include_partial else len(token_ids) - len(token_ids) % block_size
    for start in range(0, end, block_size):
        parent = next_cache_key(parent, token_ids[start : start + block_size], key)
        keys.append(parent)
    return keys


def key_bytes(key: int) -> bytes:
    return key.to_bytes(KEY_BYTES, "little")


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        events: KVEventLog | None = None,
    ) -> None:
        if num_blocks < 1:
            raise BlockPoolError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[int | None] = [None] * num_blocks
        # holds the full-attention layers' KV only (its sliding-window layers' was not sent)
        self.partial = [False] * num_blocks
        self.cached: dict[int, int] = {}  # cache key -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.events = events  # told of every key registered and evicted

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def longest_cached_prefix(self, keys: Sequence[int]) -> list[int]:
        """Block ids holding the longest run of `keys` from the start. No side effects."""
        if not self.enable_prefix_caching:
            return []
        blocks: list[int] = []
        for key in keys:
            block = self.cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_reclaimable(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` are currently free (taking them shrinks the free list)."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    def take_cached(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def allocate(self) -> int:
        if not self.free:
            raise BlockPoolError("no free KV blocks (callers must check before allocating)")
        block, _ = self.free.popitem(last=False)
        key = self.block_keys[block]
        if key is not None:
            if self.cached.get(key) == block:
                del self.cached[key]
                if self.events is not None:
                    self.events.removed(key)
            self.block_keys[block] = None
        self.partial[block] = False
        self.ref_counts[block] = 1
        return block

    def release(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise BlockPoolError(f"block {block} released more often than taken")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None
            if self.block_keys[block] is None:
                # Nothing reusable in it: hand it out before blocks that hold cached prefixes.
                self.free.move_to_end(block, last=False)

    def register(self, block: int, key: int, partial: bool = False) -> None:
        """Mark a fully computed block as holding the tokens that `key` names (`partial`: the
        full-attention layers' KV only). A whole block takes a partial one's place."""
        if not self.enable_prefix_caching:
            return
        held = self.cached.get(key)
        if held is not None:
            if partial or not self.partial[held]:
                return  # an identical block is already cached; this one stays anonymous
            self.block_keys[held] = None  # the partial one is anonymous now
            self.partial[held] = False
            if self.ref_counts[held] == 0:
                self.free.move_to_end(held, last=False)
        self.cached[key] = block
        self.block_keys[block] = key
        self.partial[block] = partial
        if self.events is not None and held is None:
            self.events.stored(key)

    def check_integrity(self) -> None:
        """Raises BlockPoolError if free + used != total or the reference counts disagree."""
        used = sum(1 for c in self.ref_counts if c > 0)
        if used + len(self.free) != self.num_blocks:
            raise BlockPoolError(f"used {used} + free {len(self.free)} != total {self.num_blocks}")
        if any(c < 0 for c in self.ref_counts):
            raise BlockPoolError("negative reference count")
        for b in self.free:
            if self.ref_counts[b] != 0:
                raise BlockPoolError(f"block {b} is free with ref count {self.ref_counts[b]}")
        for key, b in self.cached.items():
            if self.block_keys[b] != key:
                raise BlockPoolError(f"cache maps key {key:x} to block {b}, which holds another")
