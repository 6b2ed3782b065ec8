"""The linear layers of the model: plain and fused (q/k/v, gate/up) weights loaded from their
Hugging Face shards, run through torch or the compiled bf16 and quantized kernels by row count
(`linear_plan`: which kernel takes how many rows on this CPU), weight-only int8/int4.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ConfigError
from pdserve.model.fused import (
    LinearKernel,
    amx_linear_kernel,
    bf16_blocked_kernel,
    bf16_linear_kernel,
    f32_blocked_kernel,
    f32_linear_kernel,
)
from pdserve.model.isa import Isa, chosen_isa
from pdserve.model.quant import QuantizedWeight, quantize, unsupported

log = logging.getLogger(__name__)

Reduce = Callable[[torch.Tensor], None]  # sums a row-parallel output over the ranks, in place


def _can_pack(weight: torch.Tensor) -> bool:
    # oneDNN's bf16 path needs AVX512-BF16-era CPUs (or avx_ne_convert); older ones emulate it.
    # float32 weights are not packed: oneDNN's packed fp32 GEMM ran 1.3-1.4x torch's F.linear
    # here from 64 rows, but a second copy of every fp32 weight (the kernel for a few rows needs
    # the plain one) took the test suite's workers past the machine's memory.
    return (
        weight.dtype == torch.bfloat16
        and chosen_isa().native_bf16
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


@dataclass(frozen=True)
class LinearPlan:
    """How the linears of weights in `dtype` multiply, by the number of input rows: from
    `narrow_from` to fewer than `narrow_rows` through `kernel` (csrc/bf16_linear.cpp or
    csrc/f32_linear.cpp, each weight row read once), from `wide_rows` (if set, bf16 only) in fp32
    with the weight also held in fp32, the rest through torch (bf16: oneDNN's packed weights
    where the CPU has native bf16). `blocked` (AVX2 and AVX512 builds, bf16 and fp32, by default and
    under --deterministic): every row of a layer whose weight `block_weight` takes goes through this
    kernel instead."""

    dtype: torch.dtype
    kernel: LinearKernel | None
    narrow_from: int
    narrow_rows: int
    wide_rows: int | None
    blocked: LinearKernel | None = None
    tiles: bool = False  # `blocked` takes the weight in AMX tiles (amx_tiles), not panels


def linear_plan(
    dtype: torch.dtype, bf16_matmul: str, deterministic: bool = False
) -> LinearPlan | None:
    """The plan for this host's instruction set (isa.py); None: torch for every batch.
    float32: the layers' panels (`blocked`, AVX2 and AVX512 builds) for every row, other shapes a
    few rows through the kernel (F32_NARROW_ROWS). bf16 "auto" on AVX2 (bf16 emulated): the
    layers' panels for every row (bf16 widened as it is read; a prompt's rows through float32
    panels each thread widens once, at the fp32 FMA peak), the output
    projection a few rows through the row kernel and batches in fp32 (torch's emulated bf16 ran
    a 512-token SmolLM2 prefill at 90 tok/s, fp32 at 518); with native bf16 (AVX512-BF16) the
    layers take the panels too (faster than the row kernel and oneDNN at every batch there), and
    the output projection a few rows through the row kernel and the rest through oneDNN, as
    every layer on AMX hosts. "fp32"
    multiplies in fp32 from one row; "bf16" is torch's bf16 throughout. `deterministic`: every
    row through the kernel, whose per-output sums do not depend on the batch (a prompt's rows
    through its tiled path, the same sums), whatever `bf16_matmul` says: torch's float32 GEMM
    rounds a row differently with the batch, and oneDNN's kernels by row count are not ours to
    fix (on AMX hosts they switch instruction sets with the batch). Where the build has them
    (AVX2, AVX512) the layers take the panel kernel (`blocked`, each output one chain: as fast
    as oneDNN on a prompt), on AMX hosts in bf16 the AMX tiles' (`tiles`: csrc/amx_attention.cpp
    amx_linear, each row its own sums), the output projection the row kernel (a row per
    sequence)."""
    if deterministic:
        kernel = f32_linear_kernel() if dtype == torch.float32 else bf16_linear_kernel()
        if kernel is None:
            raise ConfigError("--deterministic needs the compiled CPU kernels, which cannot build")
        if dtype == torch.bfloat16 and (tiles := amx_linear_kernel()) is not None:
            # AMX: the layers on the tiles, each row its own sums (the panels ran a 16-prompt
            # load at 0.19x the default's oneDNN tiles: benchmarks/deterministic.py)
            return LinearPlan(dtype, kernel, 1, ANY_ROWS, None, tiles, tiles=True)
        blocked = bf16_blocked_kernel() if dtype == torch.bfloat16 else f32_blocked_kernel()
        return LinearPlan(dtype, kernel, 1, ANY_ROWS, None, blocked)
    if dtype == torch.float32:
        f32 = f32_linear_kernel()
        # AVX2 and AVX512 builds: the layers' panels for every row (measured below)
        panels = f32_blocked_kernel()
        return None if f32 is None else LinearPlan(dtype, f32, 1, F32_NARROW_ROWS, None, panels)
    if dtype != torch.bfloat16 or bf16_matmul == "bf16":
        return None
    kernel = bf16_linear_kernel()
    if bf16_matmul == "fp32":
        return LinearPlan(dtype, None, 0, 0, wide_rows=1)
    if chosen_isa() == Isa.AVX512 and kernel is not None:
        # the layers' panels from one row to a prompt's (measured below); the head: the row
        # kernel below NATIVE_NARROW_ROWS, oneDNN from there
        return LinearPlan(dtype, kernel, 1, NATIVE_NARROW_ROWS, None, bf16_blocked_kernel())
    if chosen_isa().native_bf16:  # AMX: oneDNN's tiles for batches (measured below)
        return LinearPlan(dtype, kernel, 1, AMX_NARROW_ROWS, None) if kernel else None
    if kernel is None:
        return LinearPlan(dtype, None, 0, 0, wide_rows=WIDE_ROWS_TORCH)
    # AVX2: the layers' panels for every row, without a float32 copy of their weights (measured
    # below); the head: one row through torch's gemv (as fast as the kernel there), a few
    # through the kernel, more in fp32
    return LinearPlan(dtype, kernel, 2, WIDE_ROWS, WIDE_ROWS, bf16_blocked_kernel())


def deterministic_kernels(dtype: torch.dtype) -> str:
    """Under --deterministic, the CPU kernels whose sums a node's bits follow (peers must agree:
    disagg/wire/terms.py): "amx" where bf16 layers take the AMX tiles, else the build's
    instruction-set level (its panels' and attention tile's vectors)."""
    if dtype == torch.bfloat16 and amx_linear_kernel() is not None:
        return "amx"
    return chosen_isa().kernel_level.name.lower()


# Where bf16 is emulated, below these many rows the bf16 weight wins by reading half the bytes.
# SmolLM2 decode on an AVX2 EPYC, tok/s: through the compiled kernel (csrc/bf16_linear.cpp) vs
# fp32, 62 vs 26 at batch 2, 106 vs 48 at 4, 123 vs 100 at 8, 113 vs 102 at 10, 129 vs 126 at
# 12, 127 vs 135 at 16; torch's emulated bf16 vs fp32: 58 vs 49 at 4, even at 6, 63 vs 86 at 8.
# One row goes through torch's matrix-vector product either way (37-38 tok/s, fp32 21-22).
WIDE_ROWS = 12
WIDE_ROWS_TORCH = 6  # where the kernel cannot be built
# With native bf16 the kernel's vdpbf16ps path beats oneDNN's packed weights below 8 rows: all
# SmolLM2 layers' linears on a 2-core AVX512-BF16 EPYC, medians of 7 alternating, ms: 9.6 vs
# 15.7 at 1 row, 10.8 vs 15.0 at 2, 13.7 vs 16.4 at 4, 17.5 vs 16.0 at 8, 31.2 vs 21.8 at 16.
NATIVE_NARROW_ROWS = 8
# On AMX oneDNN's tiles take batches, not the panels: all SmolLM2 layers' linears on a 2-core
# Xeon with AMX-BF16, panels vs row kernel vs oneDNN, medians of 7, ms: 10.0 vs 10.3 vs 11.5 at
# 1 row, 12.4 vs 12.2 vs 11.5 at 2, 13.8 vs 15.1 vs 11.1 at 4, 18.0 vs 19.0 vs 11.8 at 8, 70.9
# vs 92.9 vs 18.0 at 64, 479 vs - vs 54.0 at 512 (2,014 GFLOP/s: 8.9x the panels;
# benchmarks/linears.py, results/linears-amx-a35a7b7.json). One row stays on the row kernel;
# from two, oneDNN, in the fused decode step too (csrc/decode_layers.cpp calls the same
# operator): a SmolLM2 decode step at batch 4 23.7 -> 21.5 ms, of it the fused layers 19.4 ->
# 17.4 and the output projection 3.8 -> 2.7 (offline, 542-token prompts, 32 steps; before and
# after in two processes).
AMX_NARROW_ROWS = 2
# oneDNN lays a packed weight out for the batch size it is told. Told one row, it picks a layout
# its AMX kernels do not take: on a 2-core Xeon with AMX-BF16 (2 threads, medians of 11, random
# weights, every hint's weight in one process) all four SmolLM2 layer linears at 542 / 2,168
# rows ran 1.19x / 1.14x faster packed for 64 rows than for one, 1.02-1.12x slower at 8-64 rows;
# the 49,152-row output projection 0.98-1.03x the time at 2-16 rows, 0.88x at 64 (packed for 16:
# 1.05-1.15x slower there). In the engine, alternating in one process, a wave of four 542-token
# prompts 583 -> 519 ms (medians of 6), decode steps at batch 2 and 4 within the host's noise
# (35.2 -> 33.0 and 41.1 -> 37.2 ms, a busy host).
AMX_PACK_ROWS = 64
# The panels (bf16_blocked_linear) against the row kernel and oneDNN's packed weights, all SmolLM2
# layers' linears on a 2-core AVX512-BF16 EPYC, medians of 7, ms: 7.8 vs 8.5 vs 14.4 at 1 row,
# 7.6 vs 9.3 vs 10.8 at 4, 8.3 vs 17.9 vs 12.8 at 8, 12.0 vs 37.7 vs 17.6 at 16, 35.9 vs 119.5
# vs 42.6 at 64, 290 vs 1003 vs 310 at 512 (random weights of those shapes, 2 threads).
# float32 weights: the kernel (csrc/f32_linear.cpp) against torch's linear, all SmolLM2 layers'
# linears on a 2-core AVX512-BF16 EPYC, medians of 10, ms: 17-23 vs 42-48 at 1 row, 26 vs 77-87
# at 2, 27-35 vs 60-70 at 4, 39-50 vs 78-86 at 8, 51-71 vs 88-95 at 12, 69-82 vs 78-95 at 16,
# 93-99 vs 77-89 at 24. On AVX512 builds the layers take the panels (f32_blocked_linear) for every
# row instead: against the row kernel and torch, same layers, medians of 5, ms: 18.3 vs 25.0 vs
# 50.6 at 1 row, 24.1 vs 37.2 vs 59.7 at 8, 32.6 vs 67.7 vs 68.4 at 16, 80 vs 179 vs 136 at 64,
# 556 vs 1253 vs 809 at 512; the kernel stays for the output projection and other shapes.
F32_NARROW_ROWS = 16
# On AVX2 builds the panels' tiles (csrc/f32_linear.cpp, csrc/bf16_linear.cpp: ymm registers,
# the same one chain per output) against the row kernel and torch, all SmolLM2 layers' linears
# (each weight its own memory, so read from RAM) on a 2-core AVX2 EPYC, best of 5, ms. float32:
# 13.0 vs 15.2 vs 26.7 at 1 row, 19.0 vs 17.1 vs 47.7 at 2, 21.4 vs 18.5 vs 51.6 at 4, 32.7
# vs 23.6 vs 44.8 at 8, 40.9 vs 57.9 vs 54.4 at 16, 96 vs - vs 113 at 64, 707 vs - vs 661 at
# 512 (the row kernel is faster at 2-8 rows, but the panels replace the weight: both would
# cost twice the memory). bf16 (against the row kernel and torch's fp32 on an fp32 copy): 7.4
# vs 9.1 at 1 row, 8.9 vs 9.4 at 2, 11.3 vs 12.1 at 4, 17.4 vs 23.2 vs 43.9 at 8, 27.3 vs
# 46.8 vs 54.9 at 16, 90.5 vs - vs 115.9 at 64, 703 vs - vs 686 at 512; and no fp32 copy.


class Linear(nn.Module):
    """y = x W^T + b. In bf16 on CPU the weight is also kept pre-packed in oneDNN's blocked
    layout where the CPU has native bf16: small-batch (decode) matmuls run ~2x faster than
    through F.linear. A few rows go through the compiled kernel (LinearPlan). Where bf16 matmuls
    are emulated, the weight is also held in fp32 (`wide`), and inputs of `wide_rows` rows or
    more are multiplied in fp32, then rounded to bf16: products of bf16 values are exact in fp32
    and bf16 kernels accumulate in fp32 too, so only the order of the sums differs. With
    weight-only quantization the weight is replaced by its int8/int4 form (see quant.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self.quantized: QuantizedWeight | None = None
        self.wide: torch.Tensor | None = None
        self.wide_bias: torch.Tensor | None = None
        self.wide_rows = 0
        self.narrow: LinearKernel | None = None  # the kernel for narrow_from..narrow_rows - 1
        self.narrow_from = 0
        self.narrow_rows = 0
        self.blocked: torch.Tensor | None = None  # the weight in panels (block_weight)
        self.blocked_kernel: LinearKernel | None = None

    def pack(
        self, quantization: str = "none", keep_weight: bool = False, plan: LinearPlan | None = None
    ) -> None:
        """Call once the weights are loaded. A quantized layer drops its float weight unless
        `keep_weight` (a weight shared with the embedding); a bf16 layer follows `plan`."""
        if quantization != "none":
            self.quantized = quantize(self.weight, quantization)
            if not keep_weight:
                self.weight = nn.Parameter(self.weight.data.new_empty(0), requires_grad=False)
            return
        if plan is not None and self.weight.dtype == plan.dtype and plan.blocked is not None:
            self.blocked = (amx_tiles if plan.tiles else block_weight)(self.weight)
            if self.blocked is not None:  # the panels replace the weight
                self.blocked_kernel = plan.blocked
                self.weight = nn.Parameter(self.weight.data.new_empty(0), requires_grad=False)
                return
        if plan is not None and self.weight.dtype == plan.dtype:
            self.narrow, self.narrow_from, self.narrow_rows = (
                plan.kernel, plan.narrow_from, plan.narrow_rows
            )  # fmt: skip
            if plan.wide_rows is not None:
                self.wide = self.weight.detach().float()
                self.wide_bias = None if self.bias is None else self.bias.detach().float()
                self.wide_rows = plan.wide_rows
                return
        if _can_pack(self.weight):
            rows = AMX_PACK_ROWS if chosen_isa() == Isa.AMX else 1
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.matmul(x, self.bias)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.blocked_kernel is not None:
            assert self.blocked is not None
            out = self.blocked_kernel(x.reshape(rows, x.shape[-1]), self.blocked, self.bias)
            return out.view(*x.shape[:-1], out.shape[-1])
        if self.narrow is not None and self.narrow_from <= rows < self.narrow_rows:
            out = self.narrow(x.reshape(rows, x.shape[-1]), self.weight, self.bias)
            return out.view(*x.shape[:-1], out.shape[-1])
        if self.wide is not None and rows >= self.wide_rows:
            return F.linear(x.float(), self.wide, self.wide_bias).to(x.dtype)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """How csrc/decode_layers.cpp takes this layer: (weight, its scales, its oneDNN-packed
        form (taken from `narrow_rows` rows) or an empty tensor, the bias or an empty tensor,
        fewer rows than which it may), or None where it cannot."""
        bias = _EMPTY if self.bias is None else self.bias.detach()
        q = self.quantized
        if q is not None:
            return None if q.kernels is None else (q.data, q.scales, bias, ANY_ROWS)
        if self.blocked is not None and (self.bias is None or bias.dtype == self.blocked.dtype):
            return self.blocked, _EMPTY, bias, ANY_ROWS
        if self.narrow is not None and (self.bias is None or bias.dtype == self.weight.dtype):
            if self.packed is not None:  # AMX: from narrow_rows through oneDNN, any batch
                return self.weight.detach(), self.packed, bias, ANY_ROWS
            return self.weight.detach(), _EMPTY, bias, self.narrow_rows
        return None


_EMPTY = torch.empty(0)
ANY_ROWS = 1 << 30
PANEL = 64  # output features per panel of csrc/bf16_linear.cpp's bf16_blocked_linear


def block_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """bf16 [N, K] -> [N / 64, K / 2, 64, 2]: panels of 64 output features, each the features'
    pairs of consecutive inputs in order (what bf16_blocked_linear reads); float32 [N, K] ->
    [N / 64, K, 64] (f32_blocked_linear's). None where N is not a multiple of 64 or a bf16 K is
    odd (that layer keeps the row kernel, batch-invariant too)."""
    n, k = weight.shape
    w = weight.detach()
    if n % PANEL or (w.dtype == torch.bfloat16 and k % 2):
        return None
    if w.dtype == torch.float32:
        return w.view(n // PANEL, PANEL, k).transpose(1, 2).contiguous()
    return w.view(n // PANEL, PANEL, k // 2, 2).transpose(1, 2).contiguous()


def amx_tiles(weight: torch.Tensor) -> torch.Tensor | None:
    """bf16 [N, K] -> [N / 32, K / 32, 2, 16, 16, 2]: for each 32 output features and 32 inputs,
    two tiles (16 features each) of 16 input pairs by feature (what amx_linear reads). None where
    N or K is not a multiple of 32 (that layer keeps the row kernel, batch-invariant too)."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or n % 32 or k % 32:
        return None
    w = weight.detach().view(n // 32, 2, 16, k // 32, 16, 2)
    return w.permute(0, 3, 1, 4, 2, 5).contiguous()


class FusedLinear(Linear):
    """A linear layer whose rows are the concatenation of named shards (e.g. q, k, v)."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, rows in shards.items():
            self.offsets[name] = (start, rows)
            start += rows
        super().__init__(in_features, start, bias)

    def load_weight(self, shard: str, kind: str, tensor: torch.Tensor) -> None:
        start, rows = self.offsets[shard]
        target = self.weight if kind == "weight" else self.bias
        assert target is not None, f"checkpoint has a {shard} bias the config does not declare"
        if tensor.shape[0] != rows:
            raise ValueError(f"shard {shard}.{kind}: expected {rows} rows, got {tensor.shape[0]}")
        target.data[start : start + rows].copy_(tensor)


def layer_quantization(weight: torch.Tensor, quantization: str) -> str:
    """`quantization` where the kernels take this weight's shape, else "none" (logged)."""
    if quantization == "none" or (why := unsupported(weight, quantization)) is None:
        return quantization
    log.warning("a %s layer stays unquantized: %s", tuple(weight.shape), why)
    return "none"
