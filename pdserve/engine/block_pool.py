"""The KV block pool: reference-counted blocks, chained cache keys for prefix caching, and an
LRU of free blocks whose contents stay reusable until evicted. Plain Python, no torch.

A block is in exactly one of two states: used (ref_count > 0) or free (ref_count == 0, in the
LRU). A free block that still holds a registered cache key can be taken back by a request with
the same prefix; allocating a fresh block evicts the least recently freed one and its key.

Models with sliding-window layers (`window_blocks` set): a block's memory in those layers is
held apart, a *window part*, at most `window_blocks` of them at once. A request holds the
window part of each of its blocks its window may still read and lets go of the rest as it
advances (`drop_window`). A part nobody holds no longer counts as used; where its block is
cached whole it stays, *idle*, reusable with that prefix (as vLLM keeps a freed block's
contents until it is evicted), until another block needs a part: the least recently idle is
then given back (`on_drop` returns its memory). A block without its window part is
*partial*: it holds the full-attention layers' KV only (it can be reused only where no window
reads it).
"""

from __future__ import annotations

import hashlib
import hmac
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

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
        window_blocks: int | None = None,
        window_share: float = 0.0,
    ) -> None:
        """`window_blocks`: how many window parts fit (None: no sliding-window layers);
        `window_share`: the windowed layers' share of a whole block's bytes (for `usage`)."""
        if num_blocks < 1:
            raise BlockPoolError(f"a block pool needs at least one block, got {num_blocks}")
        if window_blocks is not None and window_blocks < 1:
            raise BlockPoolError(f"window parts of blocks: at least one, got {window_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[int | None] = [None] * num_blocks
        # holds the full-attention layers' KV only (its sliding-window layers' is not here)
        self.partial = [False] * num_blocks
        self.cached: dict[int, int] = {}  # cache key -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.events = events  # told of every key registered and evicted
        self.window_blocks = window_blocks
        self.window_share = window_share if window_blocks is not None else 0.0
        self.window_refs = [0] * num_blocks  # holders of the block's window part
        self.has_window = [False] * num_blocks
        self.num_windows = 0  # window parts held or idle
        # blocks cached whole whose window parts nobody holds, least recently idle first
        self.idle_windows: OrderedDict[int, None] = OrderedDict()
        self.on_drop: Callable[[int], None] = lambda block: None  # its memory given back

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def windowed(self) -> bool:
        return self.window_blocks is not None

    @property
    def num_windows_available(self) -> int:
        """Window parts a block can get now: unused, or idle (taken from a cached block)."""
        if self.window_blocks is None:
            return self.num_blocks
        return self.window_blocks - self.num_windows + len(self.idle_windows)

    @property
    def num_windows_held(self) -> int:
        return self.num_windows - len(self.idle_windows)

    def usage(self) -> float:
        """The share of the cache's bytes that requests hold (vLLM's kv_cache_usage_perc):
        full-attention layers by used blocks, windowed layers by held window parts."""
        if self.window_blocks is None:
            return self.num_used / self.num_blocks
        share = self.window_share
        held = (1 - share) * self.num_used + share * self.num_windows_held
        return held / ((1 - share) * self.num_blocks + share * self.window_blocks)

    def windows_needed(self, blocks: Sequence[int]) -> int:
        """Window parts that taking `blocks` (cached ones) would take off what is available:
        those idle now, and those partial (a request computing here may need them back)."""
        if self.window_blocks is None:
            return 0
        return sum(1 for b in blocks if b in self.idle_windows or not self.has_window[b])

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

    def take_cached(self, block: int, window: bool = True) -> bool:
        """Take a cached block, and its window part where it has one and `window`; whether
        the taker holds that part."""
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1
        if not (window and self.has_window[block]):
            return False
        self.idle_windows.pop(block, None)
        self.window_refs[block] += 1
        return True

    def allocate(self, window: bool = True) -> int:
        """A fresh block, with its window part (held by the taker) where the model has
        windowed layers and `window` (callers check `num_windows_available` first), else
        partial until `hold_window`."""
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
        if self.windowed:
            self.idle_windows.pop(block, None)
            if not window:
                self._give_back(block)
                self.partial[block] = True
            elif not self.has_window[block]:
                self._take_window(block)
            self.window_refs[block] = 1 if window else 0
        return block

    def hold_window(self, block: int) -> None:
        """Hold `block`'s window part, giving it one where it has none (its memory reads as
        zeros until written; callers check `num_windows_available` first)."""
        if self.has_window[block]:
            self.idle_windows.pop(block, None)
        else:
            self._take_window(block)
            # a cached partial block stays partial: its part holds no KV of its tokens
            self.partial[block] = self.block_keys[block] is not None
        self.window_refs[block] += 1

    def _take_window(self, block: int) -> None:
        assert self.window_blocks is not None
        if self.num_windows >= self.window_blocks:
            if not self.idle_windows:
                raise BlockPoolError("no window part free (callers must check first)")
            oldest, _ = self.idle_windows.popitem(last=False)
            self._give_back(oldest)
        self.has_window[block] = True
        self.num_windows += 1

    def _give_back(self, block: int) -> None:
        """`block` loses its window part (its memory returned): it is partial from now on."""
        if not self.has_window[block]:
            return
        self.idle_windows.pop(block, None)
        self.has_window[block] = False
        self.partial[block] = True
        self.num_windows -= 1
        self.on_drop(block)

    def drop_window(self, block: int) -> None:
        """A holder no longer reads `block`'s window part: the last one gives it back."""
        if self.window_refs[block] <= 0:
            raise BlockPoolError(f"window part of block {block} dropped more often than taken")
        self.window_refs[block] -= 1
        if self.window_refs[block] == 0:
            self._unheld(block)

    def _unheld(self, block: int) -> None:
        """Nobody holds `block`'s window part now: idle where the block is cached whole."""
        if self.block_keys[block] is not None and not self.partial[block]:
            self.idle_windows[block] = None
        else:
            self._give_back(block)

    def release(self, block: int, window: bool = False) -> None:
        """Let go of `block` (and of its window part, where the releaser held it)."""
        if self.ref_counts[block] <= 0:
            raise BlockPoolError(f"block {block} released more often than taken")
        self.ref_counts[block] -= 1
        if window:
            self.window_refs[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None
            if self.block_keys[block] is None:
                # Nothing reusable in it: hand it out before blocks that hold cached prefixes.
                self.free.move_to_end(block, last=False)
        if window and self.window_refs[block] == 0:
            self._unheld(block)
        elif self.ref_counts[block] == 0 and self.block_keys[block] is None:
            self._give_back(block)  # nothing reusable in it (a part no holder took)

    def register(self, block: int, key: int, partial: bool = False) -> None:
        """Mark a fully computed block as holding the tokens that `key` names (`partial`: the
        full-attention layers' KV only). A whole block takes a partial one's place."""
        if not self.enable_prefix_caching:
            return
        partial = partial or self.partial[block]
        held = self.cached.get(key)
        if held is not None:
            if partial or not self.partial[held]:
                return  # an identical block is already cached; this one stays anonymous
            self.block_keys[held] = None  # the partial one is anonymous now
            self.partial[held] = self.windowed and not self.has_window[held]
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
        if self.window_blocks is None:
            return
        if self.num_windows != sum(self.has_window) or self.num_windows > self.window_blocks:
            held = sum(self.has_window)
            raise BlockPoolError(f"{self.num_windows} window parts counted, {held} held")
        for b in range(self.num_blocks):
            if self.window_refs[b] < 0 or (self.window_refs[b] and not self.has_window[b]):
                raise BlockPoolError(f"block {b}: {self.window_refs[b]} holders of no window part")
            if self.block_keys[b] is not None and not (self.has_window[b] or self.partial[b]):
                raise BlockPoolError(f"block {b} is cached whole without its window part")
        for b in self.idle_windows:
            if self.window_refs[b] or not self.has_window[b]:
                raise BlockPoolError(f"block {b}'s window part is idle but held")
