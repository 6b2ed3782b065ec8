"""Values as they arrive from a peer or a client, checked before anything is registered: ids,
timeouts and deadlines, KV head bounds, a prefill's tensor-parallel ranks (two peers' model
fingerprints: `terms`)."""

from __future__ import annotations

import math

from pdserve.config import MAX_REQUEST_TIMEOUT_S
from pdserve.disagg.proto import pdserve_pb2 as pb

__all__ = [
    "MAX_ID_CHARS",
    "deadline_problem",
    "head_bounds_problem",
    "id_problem",
    "kv_ranks_problem",
    "timeout_problem",
]

MAX_ID_CHARS = 256  # request ids and unique keys


def timeout_problem(timeout_s: float) -> str | None:
    """Why a Generate's `timeout_s` is refused (0: the node's default), or None."""
    if timeout_s == 0:
        return None
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= MAX_REQUEST_TIMEOUT_S):
        return f"timeout_s must be in (0, {MAX_REQUEST_TIMEOUT_S:.0f}] seconds, got {timeout_s}"
    return None


def deadline_problem(deadline_unix: float, now: float) -> str | None:
    """Why a Prefill's absolute deadline is refused (not a time, or beyond the longest
    timeout), or None; a deadline already past is the caller's DEADLINE, not a bad value."""
    if not (math.isfinite(deadline_unix) and deadline_unix <= now + MAX_REQUEST_TIMEOUT_S):
        return (
            f"deadline_unix must be a time within {MAX_REQUEST_TIMEOUT_S:.0f} s, "
            f"got {deadline_unix}"
        )
    return None


def id_problem(name: str, value: str) -> str | None:
    if len(value) > MAX_ID_CHARS:
        return f"{name} of at most {MAX_ID_CHARS} characters, got {len(value)}"
    return None


def head_bounds_problem(bounds: list[int], num_kv_heads: int) -> str | None:
    """Why decode's KV head bounds (where its ranks split the heads, e.g. [0, 2, 4]) do not
    split this model's heads, or None."""
    if bounds[:1] != [0] or bounds[-1] != num_kv_heads or bounds != sorted(set(bounds)):
        return f"decode's KV head bounds {bounds[:16]} do not split {num_kv_heads} KV heads"
    return None


def kv_ranks_problem(info: pb.PeerInfo, num_kv_heads: int) -> str | None:
    """Why a prefill's tensor-parallel ranks, as its probe answer reports them, cannot supply
    every KV head of the model, or None (no ranks reported: one rank holds them all)."""
    if not info.kv_ranks:
        return None
    if len(info.kv_ranks) != info.tp_size:
        return f"tensor-parallel size {info.tp_size} with {len(info.kv_ranks)} ranks reported"
    held: set[int] = set()
    for r in info.kv_ranks:
        end = r.head_start + r.head_count
        if r.head_count < 1 or r.head_start < 0 or end > num_kv_heads:
            return f"rank {r.rank} holds KV heads [{r.head_start}, {end}) of {num_kv_heads}"
        held.update(range(r.head_start, end))
    if len(held) != num_kv_heads:
        return f"its ranks hold KV heads {sorted(held)}, not all {num_kv_heads}"
    return None
