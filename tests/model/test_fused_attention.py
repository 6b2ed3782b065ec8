"""The compiled paged attention (and the torch fallbacks) against a reference written from the
definition: each sequence's keys and values gathered position by position from its block
table, softmax(q k^T / sqrt(d)) v in float64. Decode (one query per sequence) and a run of
queries over a cached prefix (query i sees positions up to its own); block sizes, GQA groups,
lengths that are not a multiple of the block size, scattered blocks; float32 and bfloat16."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.model_runner import _decode_batch
from pdserve.model.attention import (
    KERNEL_RUN,
    PrefillSegment,
    _decode_attention,
    _prefill_attention,
)
from pdserve.model.fused import fresh_prefill_kernel, paged_decode_kernel, paged_prefill_kernel
from pdserve.model.isa import Isa
from tests.model.test_bf16_matmul import level_kernels


def reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: list[list[int]],
    lengths: list[int],
    window: int | None = None,
) -> torch.Tensor:
    """With a `window`, a query at position p sees positions [p - window + 1, p] only."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, block = cache.shape[2], cache.shape[3]
    group = heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for s, (table, length) in enumerate(zip(tables, lengths, strict=True)):
        seen = range(0 if window is None else max(0, length - window), length)
        for h in range(heads):
            kh = h // group
            keys = torch.stack([cache[table[p // block], 0, kh, p % block] for p in seen])
            values = torch.stack([cache[table[p // block], 1, kh, p % block] for p in seen])
            scores = keys.double() @ q[s, h].double() / dim**0.5
            out[s, h] = torch.softmax(scores, dim=0) @ values.double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "block,heads,kv_heads,dim",
    # the last two: 6 rows per KV head (the kernel takes 4 at a time), dims of 16 + 8 and of
    # 12 (no whole vector of 8)
    [(16, 9, 3, 64), (8, 4, 4, 32), (32, 8, 2, 16), (1, 2, 1, 8), (16, 12, 2, 24), (4, 6, 1, 12)],
)
@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        Isa.GENERIC,
        Isa.AVX2,
        Isa.AVX512,
    ],  # the compiled kernel of each level (AMX's: avx512)
    ids=lambda x: x if isinstance(x, str) else x.name.lower(),
)
def test_decode_attention_matches_the_definition(
    dtype: torch.dtype, block: int, heads: int, kv_heads: int, dim: int, backend: str | Isa
) -> None:
    kernel = None if backend == "torch" else level_kernels(backend).paged_decode_attention
    rng = random.Random(block * 100 + heads)
    torch.manual_seed(block)
    # past 512 positions the kernel takes a sequence in parts, merged after (DecodePart)
    lengths = [1, block, block + 1, 3 * block - 1, rng.randint(1, 40), 513, rng.randint(1025, 1600)]
    num_blocks = sum(-(-n // block) for n in lengths) + 8
    cache = torch.randn(num_blocks, 2, kv_heads, block, dim).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered, not consecutive
    tables = []
    for length in lengths:
        n = -(-length // block)
        tables.append([free.pop() for _ in range(n)])
    q = torch.randn(len(lengths), heads, dim).to(dtype)
    batch = _decode_batch(
        list(range(len(lengths))),
        tables,
        lengths,
        block,
        kernel,
    )
    assert batch is not None
    got = _decode_attention(q, cache, batch).double()
    want = reference(q, cache, tables, lengths)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "block,heads,kv_heads,dim", [(16, 9, 3, 64), (8, 4, 4, 32), (32, 8, 2, 16), (1, 2, 1, 8)]
)
@pytest.mark.parametrize("backend", ["fused", "torch"])
@pytest.mark.parametrize(
    "context,queries", [(40, 1), (40, 17), (64, 32), (70, 69), (33, 2)], ids=str
)
def test_prefill_over_a_cached_prefix_matches_the_definition(
    dtype: torch.dtype,
    block: int,
    heads: int,
    kv_heads: int,
    dim: int,
    backend: str,
    context: int,
    queries: int,
) -> None:
    kernel = paged_prefill_kernel()
    assert kernel is not None, "the CPU kernel did not build (g++ and ninja are needed)"
    torch.manual_seed(context * 10 + block)
    num_blocks = 2 * (-(-context // block)) + 4
    cache = torch.randn(num_blocks, 2, kv_heads, block, dim).to(dtype)
    table = random.Random(context).sample(range(num_blocks), -(-context // block))  # scattered
    q = torch.randn(queries + 3, heads, dim).to(dtype)  # the run starts at row 3 of the step
    if backend == "fused":  # called directly: _prefill_attention takes it for short runs only
        run = q[3 : 3 + queries].contiguous()
        got = kernel(run, cache, torch.tensor(table, dtype=torch.int32), context, dim**-0.5, 0)
    else:
        seg = PrefillSegment(3, queries, context, torch.tensor(table))
        fresh = torch.empty(queries + 3, kv_heads, dim, dtype=dtype)  # in the cache already
        got = _prefill_attention(q, fresh, fresh, cache, seg)
    got = got.double()
    first = context - queries
    want = torch.stack(
        [reference(q[3 + i : 4 + i], cache, [table], [first + i + 1])[0] for i in range(queries)]
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


NO_ROWS_KERNEL = (
    "this node runs the generic build (this CPU's only, or forced): it has no rows kernel, "
    "torch's SDPA takes every run"
)


def test_short_runs_over_a_prefix_read_the_cache_and_longer_ones_take_the_rows_kernel() -> None:
    """Up to KERNEL_RUN queries over a cached prefix: the kernel that reads the paged cache in
    place; a longer run: the rows kernel over the gathered context, told how many positions come
    before the run; a fresh prompt: the rows kernel over its own keys; without the rows kernel
    (a generic build) torch's SDPA, neither kernel."""
    kernel, rows = paged_prefill_kernel(), fresh_prefill_kernel()
    if rows is None:
        pytest.skip(NO_ROWS_KERNEL)
    assert kernel is not None
    paged_calls: list[int] = []
    rows_calls: list[tuple[int, int, int]] = []

    def paged_spy(*args):  # type: ignore[no-untyped-def]
        paged_calls.append(args[0].shape[0])
        return kernel(*args)

    def rows_spy(q, k, v, scale, offset=0, into=None):  # type: ignore[no-untyped-def]
        rows_calls.append((q.shape[0], k.shape[0], offset))
        return rows(q, k, v, scale, offset, into)

    cache = torch.randn(40, 2, 2, 16, 32)
    q = torch.randn(300, 4, 32)
    fresh = torch.randn(300, 2, 32)
    table = torch.randperm(40)
    runs = [(KERNEL_RUN, 300), (KERNEL_RUN + 1, 300), (200, 200)]
    for with_rows in (True, False):
        for queries, context in runs:
            seg = PrefillSegment(
                0, queries, context, table, paged_spy, rows_spy if with_rows else None
            )
            _prefill_attention(q[:queries], fresh, fresh, cache, seg)
    assert paged_calls == [KERNEL_RUN, KERNEL_RUN]
    assert rows_calls == [(KERNEL_RUN + 1, 300, 300 - KERNEL_RUN - 1), (200, 200, 0)]


def causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v in float64, GQA groups: k and v hold P + T positions, q the last
    T, query i seeing keys 0..P + i."""
    t, heads, dim = q.shape
    group = heads // k.shape[1]
    keys = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, P + T, dim]
    values = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ keys.transpose(1, 2) / dim**0.5
    first = k.shape[0] - t
    unseen = torch.arange(k.shape[0]).unsqueeze(0) > torch.arange(first, first + t).unsqueeze(1)
    scores = scores.masked_fill(unseen, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ values).transpose(0, 1)


def torch_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch's SDPA in q's dtype on the same inputs and mask (the error it makes is the bar)."""
    t, heads, dim = q.shape
    group = heads // k.shape[1]
    first = k.shape[0] - t
    seen = torch.arange(k.shape[0]).unsqueeze(0) <= torch.arange(first, first + t).unsqueeze(1)
    keys, values = (x.transpose(0, 1).repeat_interleave(group, dim=0) for x in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=seen)
    return out.transpose(0, 1)


@pytest.mark.parametrize(
    "tokens,cached,heads,kv_heads,dim",
    [(1, 0, 9, 3, 64), (31, 0, 9, 3, 64), (100, 0, 9, 3, 64), (300, 0, 4, 2, 32),
     (70, 0, 8, 8, 128), (17, 40, 9, 3, 64), (100, 37, 9, 3, 64), (64, 300, 4, 2, 32),
     (70, 129, 8, 8, 128)],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("level", [Isa.AVX2, Isa.AVX512, Isa.AMX], ids=lambda x: x.name.lower())
def test_rows_kernel_matches_the_definition(
    level: Isa, tokens: int, cached: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> None:
    """The rows kernel (csrc/prefill_attention.cpp: vdpbf16ps on avx512, float32 FMA for both
    dtypes on avx2; bf16 on amx: csrc/amx_attention.cpp's tiles) on a fresh prompt (q, k and v
    strided views of one fused projection as the model hands them over) and on a run after
    `cached` positions (the keys and values of all of them as rows): within the error of
    torch's own SDPA in the same dtype on the same inputs, against the float64 definition."""
    module = level_kernels(level)  # skips a level this CPU cannot execute, saying why
    if level == Isa.AMX and not module.amx_ready():
        pytest.skip("this CPU reports AMX but Linux gives this process no tile state")
    kernel = fresh_prefill_kernel(level)
    assert kernel is not None, f"the {level.name.lower()} build has no fresh-prompt kernel"
    torch.manual_seed(tokens + cached)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype) * 2
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, k, v = (x.view(tokens, -1, dim) for x in (q, k, v))
    if cached:
        before = (torch.randn(2, cached, kv_heads, dim) * 2).to(dtype)
        k, v = torch.cat([before[0], k]), torch.cat([before[1], v])
    want = causal_reference(q, k, v)
    got = kernel(q, k, v, dim**-0.5, cached).double()
    torch_err = (torch_sdpa(q, k, v).double() - want).abs().max().item()
    slack = 1e-3 if dtype == torch.bfloat16 else 1e-6
    assert (got - want).abs().max().item() <= 1.5 * torch_err + slack
    assert got.shape == (tokens, heads, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("level", [Isa.AVX2, Isa.AVX512, Isa.AMX], ids=lambda x: x.name.lower())
def test_rows_kernel_writes_into_the_rows_it_is_handed(level: Isa, dtype: torch.dtype) -> None:
    """Handed `into` (a prompt's rows of a step's output, as paged_attention hands them), the
    rows kernel writes its output there, the same bits as into a tensor of its own, and leaves
    the step's other rows alone; an `into` of another shape or dtype, or not contiguous, is
    refused."""
    module = level_kernels(level)  # skips a level this CPU cannot execute, saying why
    if level == Isa.AMX and not module.amx_ready():
        pytest.skip("this CPU reports AMX but Linux gives this process no tile state")
    kernel = fresh_prefill_kernel(level)
    assert kernel is not None, f"the {level.name.lower()} build has no fresh-prompt kernel"
    torch.manual_seed(1)
    tokens, heads, kv_heads, dim = 50, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype) * 2
    q, k, v = (
        x.view(tokens, -1, dim)
        for x in qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    )
    alone = kernel(q, k, v, dim**-0.5, 0, None)
    step = torch.full((tokens + 10, heads, dim), 7.0, dtype=dtype)
    rows = step[5 : 5 + tokens]
    got = kernel(q, k, v, dim**-0.5, 0, rows)
    assert got.data_ptr() == rows.data_ptr()
    assert torch.equal(rows, alone)
    assert bool((step[:5] == 7).all()) and bool((step[5 + tokens :] == 7).all())
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    for bad in (
        step[5 : 4 + tokens],
        rows.to(other),
        torch.empty(heads, tokens, dim, dtype=dtype).transpose(0, 1),
    ):
        with pytest.raises(RuntimeError, match="into is"):
            kernel(q, k, v, dim**-0.5, 0, bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block,heads,kv_heads,dim", [(16, 9, 3, 64), (8, 4, 4, 32), (1, 2, 1, 32)])
@pytest.mark.parametrize("context,queries", [(40, 17), (70, 69), (150, 100)], ids=str)
def test_long_runs_over_a_cached_prefix_match_the_definition(
    dtype: torch.dtype, block: int, heads: int, kv_heads: int, dim: int, context: int, queries: int
) -> None:
    """A run past KERNEL_RUN over a prefix in scattered blocks, as the runner hands it over (the
    run's own K/V written, the in-place kernel beside the rows kernel): the context gathered as
    rows, the rows kernel told where the run starts, against the definition."""
    rows = fresh_prefill_kernel()
    if rows is None:
        pytest.skip(NO_ROWS_KERNEL)
    assert queries > KERNEL_RUN
    offsets: list[int] = []

    def spy(q, k, v, scale, offset=0, into=None):  # type: ignore[no-untyped-def]
        offsets.append(offset)
        return rows(q, k, v, scale, offset, into)

    torch.manual_seed(context * 10 + block)
    num_blocks = 2 * (-(-context // block)) + 4
    cache = torch.randn(num_blocks, 2, kv_heads, block, dim).to(dtype)
    table = random.Random(context).sample(range(num_blocks), -(-context // block))  # scattered
    q = torch.randn(queries + 3, heads, dim).to(dtype)  # the run starts at row 3 of the step
    seg = PrefillSegment(3, queries, context, torch.tensor(table), paged_prefill_kernel(), spy)
    unused = torch.empty(queries + 3, kv_heads, dim, dtype=dtype)  # in the cache already
    got = _prefill_attention(q, unused, unused, cache, seg).double()
    assert offsets == [context - queries]
    first = context - queries
    want = torch.stack(
        [reference(q[3 + i : 4 + i], cache, [table], [first + i + 1])[0] for i in range(queries)]
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


@pytest.mark.parametrize("level", [Isa.GENERIC, Isa.AVX2, Isa.AVX512], ids=lambda x: x.name.lower())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_kv_writer_fills_the_slots_index_put_fills(
    level: Isa, dtype: torch.dtype, tokens: int
) -> None:
    """The compiled K/V copy (csrc/paged_attention.cpp write_kv_) against torch's index_put_ on
    the same slots: scattered over blocks and offsets, k and v strided views of one fused qkv as
    the layers hand them over; every other slot untouched."""
    write = level_kernels(level).write_kv_
    kv_heads, block, dim = 3, 16, 64
    torch.manual_seed(tokens)
    cache = torch.randn(40, 2, kv_heads, block, dim).to(dtype)
    want = cache.clone()
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * dim).to(dtype)
    k = qkv[:, 9 * dim : (9 + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (9 + kv_heads) * dim :].view(tokens, kv_heads, dim)
    slots = torch.randperm(40 * block)[:tokens]
    blocks, offsets = slots // block, slots % block
    want[blocks, 0, :, offsets] = k
    want[blocks, 1, :, offsets] = v
    write(cache, k, v, blocks, offsets)
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match="slot out of range"):
        write(cache, k, v, blocks + 40, offsets)


def test_steps_on_the_compiled_backend_write_kv_through_the_kernel() -> None:
    """prepare_inputs hands the compiled copy to the layers when the compiled attention runs,
    and the torch path (no kernels) keeps index_put_."""
    from pdserve.engine.model_runner import prepare_inputs
    from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
    from pdserve.engine.sequence import SamplingParams, Sequence

    seq = Sequence("r", list(range(20)), SamplingParams(max_tokens=1))
    seq.block_table = [3, 7]
    out = SchedulerOutput(scheduled=[ScheduledSeq(seq, 20, True)])
    assert prepare_inputs(out, 16, paged_decode_kernel()).meta.kv_writer is not None
    assert prepare_inputs(out, 16, None).meta.kv_writer is None


def _poison_blocks_behind(cache: torch.Tensor, table: list[int], first_seen: int) -> None:
    """NaN in every block whose positions all lie before `first_seen`: a windowed layer's
    blocks that nothing may read (they were not sent, or hold another sequence's KV)."""
    block = cache.shape[3]
    for j in range(first_seen // block):
        cache[table[j]] = float("nan")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block,heads,kv_heads,dim", [(16, 9, 3, 64), (4, 4, 1, 32)])
@pytest.mark.parametrize("backend", ["fused", "torch"])
@pytest.mark.parametrize("window", [1, 5, 16, 37, 600])
def test_windowed_decode_sees_only_its_window(
    dtype: torch.dtype, block: int, heads: int, kv_heads: int, dim: int, backend: str, window: int
) -> None:
    """A sliding-window layer's decode: each sequence's query sees its last `window` positions,
    as the definition restricted to them, whatever the blocks behind the window hold."""
    kernel = paged_decode_kernel()
    assert kernel is not None, "the CPU kernel did not build (g++ and ninja are needed)"
    torch.manual_seed(window * 7 + block)
    lengths = [1, window, window + 1, 2 * window + block + 3, 70]
    num_blocks = sum(-(-n // block) for n in lengths) + 8
    cache = torch.randn(num_blocks, 2, kv_heads, block, dim).to(dtype)
    free = random.Random(window).sample(range(num_blocks), num_blocks)
    tables = [[free.pop() for _ in range(-(-n // block))] for n in lengths]
    q = torch.randn(len(lengths), heads, dim).to(dtype)
    want = reference(q, cache, tables, lengths, window)
    for table, n in zip(tables, lengths, strict=True):
        _poison_blocks_behind(cache, table, max(0, n - window))
    rows = list(range(len(lengths)))
    batch = _decode_batch(
        rows, tables, lengths, block, kernel if backend == "fused" else None, window
    )
    assert batch is not None
    got = _decode_attention(q, cache, batch).double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("level", [Isa.GENERIC, Isa.AVX2, Isa.AVX512], ids=lambda x: x.name.lower())
def test_a_long_sequences_decode_is_the_same_bits_alone_batched_and_on_any_threads(
    level: Isa, dtype: torch.dtype
) -> None:
    """A sequence of more than 512 positions is decoded in parts merged after (DecodePart);
    where its parts fall depends on its length alone, so its output is the same bits alone, in a
    batch with others and on one thread or two."""
    kernel = level_kernels(level).paged_decode_attention
    torch.manual_seed(3)
    block, heads, kv_heads, dim = 16, 9, 3, 64
    lengths = [1500, 37, 600, 2049]
    tables, first = [], 0
    for n in lengths:
        tables.append(list(range(first, first + -(-n // block))))
        first += len(tables[-1])
    cache = torch.randn(first, 2, kv_heads, block, dim).to(dtype)
    q = torch.randn(len(lengths), heads, dim).to(dtype)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    batched = kernel(q, cache, table, lens, dim**-0.5, 0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = kernel(q, cache, table, lens, dim**-0.5, 0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, batched)
    for s in range(len(lengths)):
        alone = kernel(q[s : s + 1], cache, table[s : s + 1], lens[s : s + 1], dim**-0.5, 0)
        assert torch.equal(alone[0], batched[s]), s
    want = reference(q, cache, tables, lengths)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(batched.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", ["fused", "torch"])
@pytest.mark.parametrize(
    "context,queries,window",
    [(40, 1, 8), (40, 17, 8), (70, 70, 16), (100, 40, 33), (33, 33, 5)],
    ids=str,
)
def test_windowed_runs_of_queries_see_only_their_windows(
    dtype: torch.dtype, backend: str, context: int, queries: int, window: int
) -> None:
    """A run of queries (a prompt, or a chunk over a cached prefix) of a windowed layer: query
    i at position p sees [p - window + 1, p] only, through the kernel and through torch alike,
    whatever the blocks behind the run's first window hold."""
    kernel = paged_prefill_kernel()
    assert kernel is not None, "the CPU kernel did not build (g++ and ninja are needed)"
    block, heads, kv_heads, dim = 8, 4, 2, 32
    torch.manual_seed(context + queries + window)
    num_blocks = 2 * (-(-context // block)) + 4
    cache = torch.randn(num_blocks, 2, kv_heads, block, dim).to(dtype)
    table = random.Random(context).sample(range(num_blocks), -(-context // block))
    q = torch.randn(queries + 3, heads, dim).to(dtype)  # the run starts at row 3 of the step
    first = context - queries
    want = torch.stack(
        [
            reference(q[3 + i : 4 + i], cache, [table], [first + i + 1], window)[0]
            for i in range(queries)
        ]
    )
    _poison_blocks_behind(cache, table, max(0, first - window + 1))
    seg = PrefillSegment(3, queries, context, torch.tensor(table),
                         kernel if backend == "fused" else None)  # fmt: skip
    fresh = torch.empty(queries + 3, kv_heads, dim, dtype=dtype)  # in the cache already
    got = _prefill_attention(q, fresh, fresh, cache, seg, window).double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_exact_decode_is_the_same_bits_as_a_run_of_queries(dtype: torch.dtype) -> None:
    """--deterministic: a position's attention decoded through the exact kernel is the same
    bits as that position's query in a run over the cached prefix (a preempted request is
    recomputed so); the default kernel sums in another order and is only close."""
    exact = paged_decode_kernel(exact=True)
    fast = paged_decode_kernel()
    run_kernel = paged_prefill_kernel()
    assert exact is not None and fast is not None and run_kernel is not None
    torch.manual_seed(5)
    block, heads, kv_heads, dim, context, queries = 16, 9, 3, 64, 75, 20
    cache = torch.randn(40, 2, kv_heads, block, dim).to(dtype)
    table = random.Random(5).sample(range(40), -(-context // block))
    q = torch.randn(queries, heads, dim).to(dtype)
    scale = dim**-0.5
    run = run_kernel(q, cache, torch.tensor(table, dtype=torch.int32), context, scale, 0)
    tables = torch.tensor([table] * queries, dtype=torch.int32)
    lengths = torch.arange(context - queries + 1, context + 1, dtype=torch.int32)
    assert torch.equal(exact(q, cache, tables, lengths, scale, 0), run)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(fast(q, cache, tables, lengths, scale, 0).float(), run.float(), atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [0, 21])
@pytest.mark.parametrize(
    "block,heads,kv_heads,dim", [(16, 9, 3, 64), (8, 8, 2, 32), (16, 4, 1, 24)], ids=str
)
@pytest.mark.parametrize("context,queries", [(100, 40), (70, 3), (37, 37)], ids=str)
def test_the_avx512_run_of_queries_is_the_avx2_bits(
    dtype: torch.dtype,
    window: int,
    block: int,
    heads: int,
    kv_heads: int,
    dim: int,
    context: int,
    queries: int,
) -> None:
    """The prefix runs' tile folds eight query rows at a time and widens a whole chunk's keys
    sixteen dims at a time on AVX512, four rows at a time and element by element on AVX2: the
    same arithmetic in every lane and the same sums across lanes, so a row's bits do not depend
    on the fold or the level that took it (--deterministic decodes a query alone, through the
    one-row fold, and a preempted request recomputes it in a run). Tiles of 96, 24, 9 and 3
    rows; whole and partial chunks; a dimension that is no multiple of 16 (the element-by-
    element widening, the folds' scalar tails); windows."""
    avx512 = level_kernels(Isa.AVX512).paged_prefill_attention
    avx2 = level_kernels(Isa.AVX2).paged_prefill_attention
    torch.manual_seed(context + dim)
    num_blocks = 2 * (-(-context // block)) + 4
    cache = (torch.randn(num_blocks, 2, kv_heads, block, dim) * 2).to(dtype)
    table = random.Random(context).sample(range(num_blocks), -(-context // block))
    tab = torch.tensor(table, dtype=torch.int32)
    q = (torch.randn(queries, heads, dim) * 2).to(dtype)
    got = avx512(q, cache, tab, context, dim**-0.5, window)
    want = avx2(q, cache, tab, context, dim**-0.5, window)
    assert torch.equal(got, want), (got.double() - want.double()).abs().max()
