"""A step's last layer computes the output of the rows the step samples only (LlamaModel.forward's
`keep`): each kept row's hidden state is the bits the whole step's rows give, wherever it sits
(a prompt's last position, a decode row, in any order), where the build's panel kernels take the
linears (AVX2 and AVX512 builds: rows computed apart; a generic build's torch matmuls may round
a row otherwise in a batch of another size, so there it is within float rounding); every row's
K/V is written to the cache all the same, and a step that samples nothing (a prompt's first
chunk) gets no rows back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import prepare_inputs
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import SamplingParams, Sequence
from pdserve.model.fused import compiled, paged_decode_kernel
from tests.helpers import TINY_VOCAB, make_engine, make_tiny_model


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("last_layer")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in ("llama", "qwen2", "gemma3")}


def forward(engine: LLMEngine, batch: list[ScheduledSeq], keep: bool) -> torch.Tensor:
    kernel = paged_decode_kernel()  # the compiled kernels, or torch's where none are built
    inputs = prepare_inputs(SchedulerOutput(batch), engine.block_size, kernel,
                            window=engine.model_config.sliding_window)  # fmt: skip
    with torch.inference_mode():
        hidden = engine.model(
            inputs.input_ids, inputs.positions, engine.kv_caches, inputs.meta,
            keep=inputs.sample_rows if keep else None,
        )  # fmt: skip
    return hidden if keep else hidden[inputs.sample_rows]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_kept_rows_are_the_whole_steps_rows_and_every_kv_is_written(
    tiny_dirs: dict[str, Path], arch: str, dtype: str
) -> None:
    engine = make_engine(tiny_dirs[arch], dtype)
    gen = torch.Generator().manual_seed(7)
    tokens = lambda n: torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    decoding = Sequence("decoding", tokens(21), SamplingParams(max_tokens=4))
    prompt = Sequence("prompt", tokens(37), SamplingParams(max_tokens=4))
    chunked = Sequence("chunked", tokens(50), SamplingParams(max_tokens=4))
    seqs = (decoding, prompt, chunked)
    try:
        for seq in seqs:
            engine.kv.allocate(seq)
        forward(engine, [ScheduledSeq(decoding, 20, sample=True)], keep=False)
        decoding.num_computed_tokens = 20
        base = [c.clone() for c in engine.kv_caches]  # the decoding sequence's K/V so far

        def restore() -> None:
            for c, b in zip(engine.kv_caches, base, strict=True):
                c.copy_(b)

        # a decode row, a whole prompt and a prompt's first chunk (not sampled), in one step
        step = [ScheduledSeq(prompt, 37, sample=True), ScheduledSeq(decoding, 1, sample=True),
                ScheduledSeq(chunked, 17, sample=False)]  # fmt: skip
        whole = forward(engine, step, keep=False)
        whole_kv = [c.clone() for c in engine.kv_caches]
        restore()
        kept = forward(engine, step, keep=True)
        assert kept.shape == whole.shape == (2, engine.model_config.hidden_size)
        if compiled().panels():
            assert torch.equal(kept, whole)
        else:
            torch.testing.assert_close(kept, whole, rtol=1e-5, atol=1e-5)
        for layer, (c, w) in enumerate(zip(engine.kv_caches, whole_kv, strict=True)):
            assert torch.equal(c, w), f"layer {layer}'s K/V differ"
        # the chunk alone: nothing sampled, nothing comes back, its K/V is written
        restore()
        none = forward(engine, [ScheduledSeq(chunked, 17, sample=False)], keep=True)
        assert none.shape == (0, engine.model_config.hidden_size)
        blocks = torch.tensor(chunked.block_table[:2])  # positions 0-16 of blocks of 16
        for layer, (c, b, w) in enumerate(zip(engine.kv_caches, base, whole_kv, strict=True)):
            expected = b.clone()
            expected[blocks] = w[blocks]
            assert torch.equal(c, expected), f"layer {layer}'s K/V of the chunk"
    finally:
        for seq in seqs:
            engine.kv.free(seq)
