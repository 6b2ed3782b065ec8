"""Paged attention on CPU: writes a step's new K/V into the paged cache, then attends through
per-sequence block tables.

Cache layout per layer (DESIGN.md §5): [num_blocks, 2 (K, V), num_kv_heads, block_size, head_dim].
A step is a flat batch of tokens; each sequence contributes a contiguous run of query tokens.
Sequences with one query token (decode) are attended in one padded batch; longer runs (prefill
chunks) one sequence at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSegment:
    """One sequence's run of query tokens: positions [context_len - query_len, context_len)."""

    query_start: int
    query_len: int
    context_len: int
    block_table: torch.Tensor  # [num_blocks_of_seq] int64


@dataclass(frozen=True)
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] block id for each new token
    slot_offsets: torch.Tensor  # [T] offset inside that block
    prefills: tuple[PrefillSegment, ...]
    decode_token_index: torch.Tensor | None  # [D] rows of the flat batch that decode
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] (padded with block 0)
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_context] True where attending is allowed
    decode_max_context: int = 0


def write_kv(
    cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store the step's keys and values ([T, kv_heads, head_dim]) in their slots."""
    cache[meta.slot_blocks, 0, :, meta.slot_offsets] = k
    cache[meta.slot_blocks, 1, :, meta.slot_offsets] = v


def _gather(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, which: int
) -> torch.Tensor:
    """[kv_heads, length, head_dim] view-copy of one sequence's keys (0) or values (1)."""
    blocks = cache[block_table, which]  # [n, kv_heads, block_size, head_dim]
    n, heads, bs, dim = blocks.shape
    return blocks.transpose(0, 1).reshape(heads, n * bs, dim)[:, :length]


def _expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    # torch's fused CPU attention kernel takes 4-D inputs with equal head counts; with
    # enable_gqa it falls back to the unfused math path (~8x slower here).
    return x.repeat_interleave(group, dim=0).unsqueeze(0)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, seg: PrefillSegment
) -> torch.Tensor:
    end = seg.query_start + seg.query_len
    group = q.shape[1] // k.shape[1]
    query = q[seg.query_start : end].transpose(0, 1).unsqueeze(0)  # [1, heads, q, dim]
    if seg.query_len == seg.context_len:
        # Nothing cached before this run: the fresh keys are the whole context.
        keys = _expand_kv(k[seg.query_start : end].transpose(0, 1), group)
        values = _expand_kv(v[seg.query_start : end].transpose(0, 1), group)
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True)
    else:
        keys = _expand_kv(_gather(cache, seg.block_table, seg.context_len, 0), group)
        values = _expand_kv(_gather(cache, seg.block_table, seg.context_len, 1), group)
        first = seg.context_len - seg.query_len
        q_pos = torch.arange(first, seg.context_len).unsqueeze(1)
        mask = torch.arange(seg.context_len).unsqueeze(0) <= q_pos
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
    return out[0].transpose(0, 1)


def _decode_attention(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    assert meta.decode_token_index is not None and meta.decode_block_tables is not None
    tables = meta.decode_block_tables
    d, max_blocks = tables.shape
    blocks = cache[tables]  # [D, max_blocks, 2, kv_heads, block_size, head_dim]
    _, _, _, heads, bs, dim = blocks.shape
    kv = blocks.permute(2, 0, 3, 1, 4, 5).reshape(2, d, heads, max_blocks * bs, dim)
    keys = kv[0, :, :, : meta.decode_max_context]
    values = kv[1, :, :, : meta.decode_max_context]
    # One query token per sequence: the query heads sharing a KV head become that head's
    # "query rows" (no causal order among them), so no KV expansion is needed.
    num_heads = q.shape[1]
    query = q[meta.decode_token_index].view(d, heads, num_heads // heads, dim)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=meta.decode_mask)
    return out.reshape(d, num_heads, dim)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """q: [T, heads, dim]; k, v: [T, kv_heads, dim] (already rotated). Returns [T, heads, dim]."""
    write_kv(cache, k, v, meta)
    if not meta.prefills and meta.decode_token_index is not None:
        return _decode_attention(q, cache, meta)
    out = torch.empty_like(q)
    for seg in meta.prefills:
        out[seg.query_start : seg.query_start + seg.query_len] = _prefill_attention(
            q, k, v, cache, seg
        )
    if meta.decode_token_index is not None:
        out[meta.decode_token_index] = _decode_attention(q, cache, meta)
    return out
