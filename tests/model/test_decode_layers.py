"""The compiled kernels behind fast small-batch decode, each against an independent reference:

- q4_linear / q8_linear (csrc/quant_linear.cpp) against the float64 product with the weight
  dequantized from the documented layout, within the error that rounding x to int8 per group of
  32 allows (the kernels take x so, as llama.cpp does);
- decode_layers (csrc/decode_layers.cpp), a decode step's layers in one call, against the
  model's Python layers on the same weights and kernels: several sequences of different lengths
  decode together, token by token, teacher-forced, and every step's logits agree within bf16's
  rounding noise (only the order of RMSNorm's sum and the exp in SiLU differ), and in fp32 are
  bit-identical."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import prepare_inputs
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import SamplingParams, Sequence
from pdserve.model.fused import compiled, paged_decode_kernel
from pdserve.model.isa import Isa, chosen_isa
from pdserve.model.quant import INT4_GROUP, quantize
from tests.helpers import TINY_VOCAB, make_engine, make_tiny_model


def kernels():  # type: ignore[no-untyped-def]
    module = compiled()
    assert module is not None, "the CPU kernels did not build (g++ and ninja are needed)"
    return module


def dequantized(kind: str, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weight the layout documents, in float64."""
    if kind == "int8":
        return data.double() * scales.double()[:, None]
    n, k = data.shape[0], data.shape[1] * 2
    groups = data.view(n, k // INT4_GROUP, INT4_GROUP // 2)
    q = torch.cat([groups & 0x0F, groups >> 4], dim=-1).double()  # low nibbles first
    step, low = scales[:, 0].double(), scales[:, 1].double()
    return (q * step[..., None] + low[..., None]).reshape(n, k)


def activation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N] bound on |x W^T - x' W^T| when x' is x rounded to int8 per group of 32: each
    element moves by at most half its group's step, amax / 127 / 2."""
    m, k = x.shape
    step = x.double().abs().view(m, k // INT4_GROUP, INT4_GROUP).amax(-1) / 127
    per_input = step.repeat_interleave(INT4_GROUP, dim=1) / 2  # [M, K]
    return per_input @ w.abs().T


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("k,n,bias", [(96, 48, False), (576, 160, True), (64, 16, True)])
def test_quantized_linear_is_the_product_with_x_rounded_per_group(
    kind: str, rows: int, k: int, n: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    qw = quantize(w, kind)
    assert qw.kernels is not None, "pdserve's layout is used where its kernels build"
    x = (torch.randn(rows, k, generator=gen) * 3).bfloat16()
    b = (torch.randn(n, generator=gen) * 0.1).bfloat16() if bias else None
    got = qw.matmul(x, b).double()
    full = dequantized(kind, qw.data, qw.scales)
    exact = x.double() @ full.T + (0 if b is None else b.double())
    bound = activation_bound(x, full) + exact.abs() * 2**-8 + 1e-5  # and the bf16 output
    err = (got - exact).abs()
    assert (err <= bound).all(), (err - bound).max()
    # and it is the quantized weight, not the bf16 one, that was multiplied
    assert (full - w.double()).abs().max() > 0


def test_quantized_linear_rejects_what_it_cannot_take() -> None:
    module = kernels()
    w = quantize(torch.randn(16, 64).bfloat16(), "int4")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        module.q4_linear(torch.randn(1, 48).bfloat16(), w.data, w.scales, None)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        module.q4_linear(torch.randn(1, 64).half(), w.data, w.scales, None)


def teacher_forced_decode(
    engine: LLMEngine, prompts: list[list[int]], continuations: list[list[int]]
) -> list[torch.Tensor]:
    """Each prompt prefilled alone, then the continuations fed one token per sequence per
    step, all sequences in one decode batch; the logits of every decode step, [seqs, vocab]."""
    kernel = paged_decode_kernel()
    seqs = [
        Sequence(f"s{i}", p + c, SamplingParams(max_tokens=1))
        for i, (p, c) in enumerate(zip(prompts, continuations, strict=True))
    ]
    steps = []
    try:
        for seq in seqs:
            engine.kv.allocate(seq)
        with torch.inference_mode():
            pairs = zip(seqs, prompts, strict=True)
            batches = [[ScheduledSeq(s, len(p), sample=True)] for s, p in pairs]
            batches += [[ScheduledSeq(s, 1, sample=True) for s in seqs]] * len(continuations[0])
            for i, batch in enumerate(batches):
                inputs = prepare_inputs(SchedulerOutput(batch), engine.block_size, kernel)
                hidden = engine.model(
                    inputs.input_ids, inputs.positions, engine.kv_caches, inputs.meta
                )
                if i >= len(prompts):
                    steps.append(engine.model.compute_logits(hidden[inputs.sample_rows]))
                for s in batch:
                    s.seq.num_computed_tokens += s.num_new_tokens
    finally:
        for seq in seqs:
            engine.kv.free(seq)
    return steps


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decode_layers")
    return {
        "llama": make_tiny_model(root / "llama"),
        "qwen2": make_tiny_model(root / "qwen2", arch="qwen2"),  # q/k/v biases
    }


@pytest.mark.parametrize("lengths", [(3, 9, 16), (9,)], ids=["batch3", "batch1"])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_layers_match_the_python_layers(
    tiny_dirs: dict[str, Path], arch: str, quantization: str, lengths: tuple[int, ...]
) -> None:
    """Batches of one and of three: on AMX hosts one row takes the row kernel and more
    oneDNN's packed weights, in the fused step as in the Python layers."""
    engine = make_engine(
        tiny_dirs[arch], dtype="bfloat16", block_size=4, prefix_caching=False,
        quantization=quantization,
    )  # fmt: skip
    if chosen_isa() == Isa.AMX and quantization == "none":  # the oneDNN side is in the step
        assert engine.model.fused_decode is not None
        layers, _, packed_from = engine.model.fused_decode
        assert packed_from == 2 and all(layer[3].is_mkldnn for layer in layers)
    fused, python = fused_and_python(engine, lengths)
    for got, want in zip(fused, python, strict=True):
        scale = want.abs().mean()
        assert (got - want).abs().max() <= 0.05 * scale
        assert (got - want).abs().mean() <= 0.005 * scale
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp32_decode_layers_are_bit_identical_to_the_python_layers(
    tiny_dirs: dict[str, Path], arch: str
) -> None:
    """In fp32 the fused step runs the Python path's operators: nothing may move, so that fp32
    stays token-identical between batched and alone (test_generation.py)."""
    engine = make_engine(tiny_dirs[arch], dtype="float32", block_size=4, prefix_caching=False)
    fused, python = fused_and_python(engine)
    for got, want in zip(fused, python, strict=True):
        assert torch.equal(got, want)


def fused_and_python(
    engine: LLMEngine, lengths: tuple[int, ...] = (3, 9, 16)
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The logits of the same teacher-forced decode with the fused step and without it; the
    default lengths end inside one block, across blocks, on a block boundary."""
    assert engine.model.fused_decode is not None, "the fused decode path is not in use"
    rng = random.Random(7)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in lengths]
    continuations = [[rng.randrange(3, TINY_VOCAB) for _ in range(6)] for _ in lengths]
    fused = teacher_forced_decode(engine, prompts, continuations)
    layers, engine.model.fused_decode = engine.model.fused_decode, None
    python = teacher_forced_decode(engine, prompts, continuations)
    engine.model.fused_decode = layers
    return fused, python


def test_decode_layers_run_only_where_they_can(tiny_dirs: dict[str, Path]) -> None:
    bf16 = make_engine(tiny_dirs["llama"], dtype="bfloat16", bf16_matmul="bf16")
    assert bf16.model.fused_decode is None  # no bf16 kernel path chosen: nothing to fuse with
    widened = make_engine(tiny_dirs["llama"], dtype="bfloat16", bf16_matmul="fp32")
    assert widened.model.fused_decode is None  # fp32 matmuls of bf16 weights: not in the step
