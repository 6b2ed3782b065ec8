"""Paged attention on CPU: writes a step's new K/V into the paged cache, then attends through
per-sequence block tables.

Cache layout per layer (DESIGN.md §5): [num_blocks, 2 (K, V), num_kv_heads, block_size, head_dim].
A step is a flat batch of tokens; each sequence contributes a contiguous run of query tokens.
Sequences with one query token (decode) are attended together straight from the paged cache by
the compiled kernel (`fused.py`), or, where it cannot be built, block by block in torch
(DecodeBatch); longer runs (prompts, prefill chunks) one sequence at a time: a short run over a
cached prefix straight from the paged cache, a longer one (and a fresh prompt) through the
compiled kernel over its keys as rows (in bf16 on AMX: on the tiles), or torch's fused attention
where there is none.

A layer of sliding-window attention (Gemma 3's local layers, Mistral's, Qwen's past
max_window_layers) passes its window: a query at position p sees [p - window + 1, p], as Hugging
Face's `sliding_window`. Positions no query of a step sees are never read: a windowed layer's
blocks behind the window may hold nothing of the sequence's (they were not sent, or their
memory went back to the system).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model.fused import DecodeKernel, FreshKernel, KVWriter, PrefillKernel


@dataclass(frozen=True)
class PrefillSegment:
    """One sequence's run of query tokens: positions [context_len - query_len, context_len)."""

    query_start: int
    query_len: int
    context_len: int
    block_table: torch.Tensor  # [num_blocks_of_seq] int64
    kernel: PrefillKernel | None = None  # over a cached prefix: the fused kernel; None: torch
    # runs past KERNEL_RUN over a prefix, and fresh prompts: the rows kernel; None: torch's SDPA
    fresh: FreshKernel | None = None
    exact: bool = False  # every run through `kernel` (--deterministic: per-query sums by position)


@dataclass(frozen=True)
class PairLayout:
    """The torch path's view of a decode batch: a "pair" is (sequence, one of its blocks).
    Scores are computed per pair straight from the gathered blocks, then laid out padded
    [sequence, max_blocks * block_size] only for the softmax."""

    pair_blocks: torch.Tensor  # [P] block id of each pair
    pair_seq: torch.Tensor  # [P] which decode sequence the pair belongs to
    pair_slot: torch.Tensor  # [P] seq * max_blocks + block index: the pair's padded position
    bias: torch.Tensor  # [D, 1, 1, max_blocks * block_size] float32: 0 attend, -inf not


@dataclass(frozen=True)
class DecodeBatch:
    """Sequences with one query token, attended through the fused kernel from their block
    tables, or block by block through torch (`pairs`, built only where there is no kernel)."""

    token_index: torch.Tensor  # [D] rows of the flat batch
    max_blocks: int
    block_tables: torch.Tensor  # [D, max_blocks] int32, zero-padded (for the fused kernel)
    lengths: torch.Tensor  # [D] int32 context lengths
    kernel: DecodeKernel | None = None  # the fused kernel; None: the torch path
    exact: bool = False  # `kernel` is the exact one (--deterministic; the fused step uses it too)
    window: int | None = None  # the pairs and bias cover only this many last positions
    pairs: PairLayout | None = None  # the torch path's layout (None with a kernel)


@dataclass(frozen=True)
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] block id for each new token
    slot_offsets: torch.Tensor  # [T] offset inside that block
    prefills: tuple[PrefillSegment, ...]
    decode: DecodeBatch | None
    kv_writer: KVWriter | None = None  # the compiled copy into the slots; None: index_put_
    window_decode: DecodeBatch | None = None  # `decode` as the windowed layers see it


def write_kv(
    cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store the step's keys and values ([T, kv_heads, head_dim]) in their slots."""
    if meta.kv_writer is not None:
        meta.kv_writer(cache, k, v, meta.slot_blocks, meta.slot_offsets)
        return
    cache[meta.slot_blocks, 0, :, meta.slot_offsets] = k
    cache[meta.slot_blocks, 1, :, meta.slot_offsets] = v


# Runs over a cached prefix up to this many queries read the paged cache in place; longer ones
# gather the context's keys and values as rows for the rows kernel. SmolLM2's shapes, 2 threads,
# 2-core AVX512-BF16 EPYC (benchmarks/results/prefill_attention-zen4-e58c56a.json), in-place
# kernel vs gather + rows kernel: bf16 16 queries over 256 / 1024 positions 0.12 / 0.43 vs
# 0.10 / 0.25 ms, 32 over 256 0.20 vs 0.11, 584 over 600 3.82 vs 1.42 (torch's gather + SDPA
# 6.82); float32 16 over 256 0.12 vs 0.13, 32 over 256 0.21 vs 0.17.
KERNEL_RUN = 16


def rows_kernel_takes(dtype: torch.dtype, dim: int) -> bool:
    """Whether runs of this dtype and head size go through the rows kernel (csrc/
    prefill_attention.cpp, csrc/amx_attention.cpp: head sizes that are multiples of 32 up to
    256) rather than torch's SDPA. At 542 tokens on SmolLM2's shapes (2 threads) it ran in 1.6 ms
    (bf16) / 2.5 ms (float32) where torch's SDPA took 6.6 / 5.8 on an AVX512-BF16 EPYC; on an
    AVX2 EPYC ~3.5 ms (both dtypes) where SDPA took ~6-8 (a 512-token prefill 0.85 s from 0.96
    in fp32); on AMX see `fused.fresh_prefill_kernel`."""
    return dtype in (torch.bfloat16, torch.float32) and dim % 32 == 0 and dim <= 256


def _gather_rows(
    cache: torch.Tensor, block_table: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values as rows [length, kv_heads, head_dim] (the rows kernel's
    layout; transposed, torch's SDPA's), copied out of its blocks."""
    blocks = cache.index_select(0, block_table[: -(-length // cache.shape[3])])
    n, _, heads, bs, dim = blocks.shape  # [n, 2, kv_heads, bs, dim] -> [2, n * bs, kv_heads, dim]
    rows = blocks.permute(1, 0, 3, 2, 4).reshape(2, n * bs, heads, dim)[:, :length]
    return rows[0], rows[1]


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """torch's fused attention of rows [positions, heads, dim] (causal where `mask` is None),
    the same layout out. Views, no copies: each KV head shared by its group of query heads
    through `enable_gqa`, which torch 2.13's fused CPU kernel takes (the KV heads expanded by
    copies took 1.19 vs 0.99 ms, a 542-token SmolLM2 prompt bf16, 3.88 vs 3.35 float32, on a
    2-core Xeon with AMX; the same bits)."""
    query, keys, values = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(
        query,
        keys,
        values,
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    seg: PrefillSegment,
    window: int | None = None,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """The run's attention output: in `into` (the run's rows of the step's output) where the rows
    kernel takes the run, else a new tensor."""
    if window is not None and seg.context_len > window:  # some query sees less than all
        return _windowed_prefill(q, cache, seg, window)
    end = seg.query_start + seg.query_len
    over_prefix = seg.query_len < seg.context_len and seg.query_len <= KERNEL_RUN
    if seg.kernel is not None and (seg.exact or over_prefix):
        # Over a cached prefix: straight from the paged cache (this run's K/V are written).
        return seg.kernel(  # type: ignore[no-any-return]  # the compiled kernel is untyped
            q[seg.query_start : end].contiguous(), cache, seg.block_table.to(torch.int32),
            seg.context_len, q.shape[2] ** -0.5, 0,
        )  # fmt: skip
    first = seg.context_len - seg.query_len  # positions cached before the run
    if seg.fresh is not None and rows_kernel_takes(q.dtype, q.shape[2]):
        if first == 0:  # nothing cached before this run: the fresh keys are the whole context
            keys, values = k[seg.query_start : end], v[seg.query_start : end]
        else:  # the run's own K/V are in the cache already: every position's, as rows
            keys, values = _gather_rows(cache, seg.block_table, seg.context_len)
        return seg.fresh(q[seg.query_start : end], keys, values, q.shape[2] ** -0.5, first, into)
    if first == 0:
        return _sdpa(q[seg.query_start : end], k[seg.query_start : end], v[seg.query_start : end])
    key_rows, value_rows = _gather_rows(cache, seg.block_table, seg.context_len)
    q_pos = torch.arange(first, seg.context_len).unsqueeze(1)
    mask = torch.arange(seg.context_len).unsqueeze(0) <= q_pos
    return _sdpa(q[seg.query_start : end], key_rows, value_rows, mask)


def _windowed_prefill(
    q: torch.Tensor, cache: torch.Tensor, seg: PrefillSegment, window: int
) -> torch.Tensor:
    """A run of queries of a windowed layer (this run's K/V are in the cache): the compiled kernel
    reads each query's window only, whatever the run's length (a fresh prompt too: torch's SDPA
    would read and mask the whole context); the torch path gathers what the run's first query
    sees onwards and masks the rest."""
    end = seg.query_start + seg.query_len
    if seg.kernel is not None:
        return seg.kernel(  # type: ignore[no-any-return]  # the compiled kernel is untyped
            q[seg.query_start : end].contiguous(), cache, seg.block_table.to(torch.int32),
            seg.context_len, q.shape[2] ** -0.5, window,
        )  # fmt: skip
    first = seg.context_len - seg.query_len
    begin = max(0, first - window + 1)  # nothing before is seen by any query of the run
    # from the block holding `begin`: those before are not read (their memory may be gone)
    skip = begin // cache.shape[3] * cache.shape[3]  # positions in the blocks skipped
    table, length, at = (
        seg.block_table[skip // cache.shape[3] :],
        seg.context_len - skip,
        begin - skip,
    )
    key_rows, value_rows = _gather_rows(cache, table, length)
    q_pos = torch.arange(first, seg.context_len).unsqueeze(1)
    k_pos = torch.arange(begin, seg.context_len).unsqueeze(0)
    mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
    return _sdpa(q[seg.query_start : end], key_rows[at:], value_rows[at:], mask)


def _decode_attention(q: torch.Tensor, cache: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
    if batch.kernel is not None:
        query = q.index_select(0, batch.token_index)
        scale = q.shape[2] ** -0.5
        return batch.kernel(
            query, cache, batch.block_tables, batch.lengths, scale, batch.window or 0
        )
    return _decode_attention_torch(q, cache, batch)


def _decode_attention_torch(
    q: torch.Tensor, cache: torch.Tensor, batch: DecodeBatch
) -> torch.Tensor:
    num_heads, dim = q.shape[1], q.shape[2]
    _, _, kv_heads, bs, _ = cache.shape
    group = num_heads // kv_heads
    d = batch.token_index.shape[0]
    pairs = batch.pairs
    assert pairs is not None, "a decode batch without a kernel carries its pair layout"
    keys = cache[:, 0].index_select(0, pairs.pair_blocks)  # [P, kv_heads, bs, dim]
    values = cache[:, 1].index_select(0, pairs.pair_blocks)
    # The query heads that share a KV head are that head's rows: [P, kv_heads, group, dim].
    query = q.index_select(0, batch.token_index).view(d, kv_heads, group, dim)
    scores = torch.matmul(query.index_select(0, pairs.pair_seq), keys.transpose(-1, -2))
    padded = scores.new_full(
        (d * batch.max_blocks, kv_heads, group, bs), float("-inf"), dtype=torch.float32
    )
    padded.index_copy_(0, pairs.pair_slot, scores.float())
    width = batch.max_blocks * bs
    padded = padded.view(d, batch.max_blocks, kv_heads, group, bs).permute(0, 2, 3, 1, 4)
    logits = padded.reshape(d, kv_heads, group, width) * dim**-0.5 + pairs.bias
    probs = torch.softmax(logits, dim=-1).to(q.dtype)
    probs = probs.view(d, kv_heads, group, batch.max_blocks, bs).permute(0, 3, 1, 2, 4)
    probs = probs.reshape(d * batch.max_blocks, kv_heads, group, bs).index_select(
        0, pairs.pair_slot
    )
    partial = torch.matmul(probs, values)  # [P, kv_heads, group, dim]
    out = torch.zeros((d, kv_heads, group, dim), dtype=torch.float32)
    out.index_add_(0, pairs.pair_seq, partial.float())
    return out.to(q.dtype).view(d, num_heads, dim)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None = None,
) -> torch.Tensor:
    """q: [T, heads, dim]; k, v: [T, kv_heads, dim] (already rotated). Returns [T, heads, dim].
    `window`: this layer's sliding window, None for full attention."""
    write_kv(cache, k, v, meta)
    decode = meta.decode if window is None else meta.window_decode
    if decode is None and meta.decode is not None:
        raise ValueError("a windowed layer's decode rows need their batch (prepare_inputs' window)")
    if not meta.prefills and decode is not None:
        return _decode_attention(q, cache, decode)  # rows are in decode order already
    if decode is None and len(meta.prefills) == 1 and meta.prefills[0].query_len == q.shape[0]:
        # the whole step: no copy
        return _prefill_attention(q, k, v, cache, meta.prefills[0], window)
    out = torch.empty(q.shape, dtype=q.dtype)
    for seg in meta.prefills:
        rows = out[seg.query_start : seg.query_start + seg.query_len]
        done = _prefill_attention(q, k, v, cache, seg, window, rows)
        if done is not rows:  # not written in place (a wave of four 542-token prompts: ~8 ms)
            rows.copy_(done)
    if decode is not None:
        out[decode.token_index] = _decode_attention(q, cache, decode)
    return out
