"""Turns a scheduled step into tensors (token ids, positions, slots, block tables), runs the
model over the paged KV cache, and returns logits for the requests that sample this step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.tensor_parallel import TensorParallelGroup
from pdserve.model.attention import AttentionMetadata, DecodeBatch, PairLayout, PrefillSegment
from pdserve.model.fused import (
    DecodeKernel,
    fresh_prefill_kernel,
    kv_writer,
    paged_decode_kernel,
    paged_prefill_kernel,
)
from pdserve.model.layers import LayerDone
from pdserve.model.llama import LlamaModel


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the flat batch whose logits are sampled


def _long(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def prepare_inputs(
    out: SchedulerOutput,
    block_size: int,
    decode_kernel: DecodeKernel | None = None,
    exact: bool = False,
    window: int | None = None,
) -> StepInputs:
    """With `decode_kernel` (the compiled attention backend), runs over a cached prefix take
    the compiled prefill kernel too, and fresh prompts the fresh-prompt one where the build has it.
    `exact` (--deterministic): every run of queries through the paged prefill kernel, whose
    per-query sums depend on the query's position only, and decode through the same tile
    (`paged_decode_kernel(exact=True)`, whatever `decode_kernel` was given).
    `window`: the model's sliding window, if it has windowed layers (their decode batch)."""
    if exact and decode_kernel is not None:
        decode_kernel = paged_decode_kernel(exact=True)
    prefill_kernel = None if decode_kernel is None else paged_prefill_kernel()
    fresh_kernel = None if decode_kernel is None or exact else fresh_prefill_kernel()
    ids: list[int] = []
    positions: list[int] = []
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    prefills: list[PrefillSegment] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    sample_rows: list[int] = []
    for s in out.scheduled:
        seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
        row = len(ids)
        ids.extend(seq.all_token_ids[start : start + n])
        pos = range(start, start + n)
        positions.extend(pos)
        slot_blocks.extend(seq.block_table[p // block_size] for p in pos)
        slot_offsets.extend(p % block_size for p in pos)
        context = start + n
        table = seq.block_table[: -(-context // block_size)]
        if n == 1:
            decode_rows.append(row)
            decode_tables.append(table)
            decode_lens.append(context)
        else:
            prefills.append(
                PrefillSegment(
                    row, n, context, _long(table), prefill_kernel, fresh_kernel, exact=exact
                )
            )
        if s.sample:
            sample_rows.append(row + n - 1)
    meta = AttentionMetadata(
        slot_blocks=_long(slot_blocks),
        slot_offsets=_long(slot_offsets),
        prefills=tuple(prefills),
        decode=_decode_batch(
            decode_rows, decode_tables, decode_lens, block_size, decode_kernel, exact=exact
        ),
        kv_writer=None if decode_kernel is None else kv_writer(),
        window_decode=None
        if window is None
        else _decode_batch(
            decode_rows, decode_tables, decode_lens, block_size, decode_kernel, window, exact
        ),
    )
    return StepInputs(_long(ids), _long(positions), meta, _long(sample_rows))


def _decode_batch(
    rows: list[int],
    tables: list[list[int]],
    lengths: list[int],
    block_size: int,
    kernel: DecodeKernel | None = None,
    window: int | None = None,
    exact: bool = False,
) -> DecodeBatch | None:
    """The torch path's pair layout only where there is no `kernel` (a decode step's inputs are
    built every step). With a `window`, the pairs are only the blocks that hold a position the
    window sees."""
    if not rows:
        return None
    max_blocks = max(len(t) for t in tables)
    return DecodeBatch(
        token_index=_long(rows),
        max_blocks=max_blocks,
        block_tables=torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32
        ),
        lengths=torch.tensor(lengths, dtype=torch.int32),
        kernel=kernel,
        exact=exact and kernel is not None,
        window=window,
        pairs=None
        if kernel is not None
        else _pair_layout(tables, lengths, max_blocks, block_size, window),
    )


def _pair_layout(
    tables: list[list[int]],
    lengths: list[int],
    max_blocks: int,
    block_size: int,
    window: int | None,
) -> PairLayout:
    # each sequence's first block in the window
    starts = [0 if window is None else max(0, n - window) // block_size for n in lengths]
    pairs = [(i, j) for i, t in enumerate(tables) for j in range(starts[i], len(t))]
    positions = torch.arange(max_blocks * block_size).unsqueeze(0)
    ends = _long(lengths).unsqueeze(1)
    hidden = positions >= ends
    if window is not None:
        hidden |= positions < ends - window
    bias = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
    return PairLayout(
        pair_blocks=_long([tables[i][j] for i, j in pairs]),
        pair_seq=_long([i for i, _ in pairs]),
        pair_slot=_long([i * max_blocks + j for i, j in pairs]),
        bias=bias.view(len(tables), 1, 1, -1),
    )


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[torch.Tensor],
        block_size: int,
        decode_kernel: DecodeKernel | None = None,
        tp: TensorParallelGroup | None = None,
        exact: bool = False,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.decode_kernel = decode_kernel
        self.tp = tp
        self.exact = exact  # --deterministic: see prepare_inputs

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, layer_done: LayerDone | None = None) -> torch.Tensor:
        """float32 logits [number of sampling requests, vocab], in scheduling order. With
        tensor parallelism the workers get the same inputs first and compute alongside."""
        inputs = prepare_inputs(
            out, self.block_size, self.decode_kernel, self.exact, self.model.config.sliding_window
        )
        if self.tp is not None:
            self.tp.send_step(inputs)
        try:
            hidden = self.model(
                inputs.input_ids,
                inputs.positions,
                self.kv_caches,
                inputs.meta,
                layer_done,
                keep=inputs.sample_rows,
            )
            return self.model.compute_logits(hidden)
        except Exception as e:
            if self.tp is None:
                raise
            raise self.tp.step_failed(e) from e  # the ranks are out of step: no later step runs
