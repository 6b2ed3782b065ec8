"""Weight-only quantization of linear layers: `int8` keeps one scale per output row (symmetric);
`int4` keeps a scale and a minimum per group of 32 inputs (the layout of GGUF's Q4_1, so the
bundled model's 4-bit weights map onto it closely). Only the weights shrink, which is what bounds
small-batch decode on CPU.

Where pdserve's kernels build (csrc/quant_linear.cpp), they multiply as llama.cpp does: each input
row is rounded to int8 per group of 32 and the dot products are taken in integers (1.3-1.6x
torch's int4 kernel at one row on SmolLM2's shapes, 2.2x its int8 one on the output
projection). Elsewhere torch's weight-only kernels run, with activations in the model's dtype."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdserve.model.fused import compiled

INT4_GROUP = 32


@dataclass(frozen=True)
class QuantizedWeight:
    """In pdserve's layout when `kernels` is set (see csrc/quant_linear.cpp), else torch's."""

    kind: str  # "int8" or "int4"
    data: torch.Tensor  # int8: [N, K] int8; int4: [N, K/2] uint8 (ours) or torch's packing
    # int8: [N] (float32 ours, else the model's dtype); int4: [N, 2, K/32] float32 steps then
    # minimums (ours), or torch's [K/32, N, 2] (scale, zero) pairs in the model's dtype
    scales: torch.Tensor
    out_features: int
    kernels: Any = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] in the model's dtype -> x @ W^T + bias [..., N], W the dequantized weight."""
        flat = x.reshape(-1, x.shape[-1])
        if self.kernels is not None:
            linear = self.kernels.q4_linear if self.kind == "int4" else self.kernels.q8_linear
            y = linear(flat, self.data, self.scales, bias)
        else:
            if self.kind == "int8":
                y = torch._weight_int8pack_mm(flat, self.data, self.scales)
            else:
                y = torch._weight_int4pack_mm_for_cpu(flat, self.data, INT4_GROUP, self.scales)
            y = y if bias is None else y + bias
        return y.reshape(*x.shape[:-1], self.out_features)


def unsupported(weight: torch.Tensor, kind: str) -> str | None:
    """Why `weight` cannot take `kind` on this build, or None."""
    n, k = weight.shape
    if kind == "int4" and (k % INT4_GROUP or n % 16):
        return f"int4 needs {INT4_GROUP} | input features and 16 | output features, got {k}, {n}"
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"weight-only kernels take float weights, got {weight.dtype}"
    return None


def quantize(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    """Quantize a [N, K] weight, in pdserve's layout where its kernels build."""
    if (why := unsupported(weight, kind)) is not None:
        raise ValueError(why)
    w = weight.detach().float()
    n, k = w.shape
    kernels = compiled() if k % INT4_GROUP == 0 else None  # the kernels take groups of 32
    if kind == "int8":
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        if kernels is not None:
            return QuantizedWeight(kind, q, scale.contiguous(), n, kernels)
        return QuantizedWeight(kind, q, scale.to(weight.dtype), n)
    if kind == "int4":
        groups = w.reshape(n, k // INT4_GROUP, INT4_GROUP)
        low = groups.amin(dim=-1, keepdim=True)
        scale = ((groups.amax(dim=-1, keepdim=True) - low) / 15).clamp(
            min=torch.finfo(torch.float32).tiny
        )
        q = torch.round((groups - low) / scale).clamp(0, 15).to(torch.uint8)  # [N, K/G, G]
        if kernels is not None:  # a group's low nibbles hold its first 16 values (Q4_1's order)
            half = INT4_GROUP // 2
            nibbles = (q[..., :half] | (q[..., half:] << 4)).reshape(n, k // 2).contiguous()
            steps = torch.stack([scale[..., 0], low[..., 0]], dim=1).contiguous()
            return QuantizedWeight(kind, nibbles, steps, n, kernels)
        q = q.to(torch.int32).reshape(n, k)
        # torch's kernel computes (q - 8) * scale + zero, so zero = low + 8 * scale.
        pairs = torch.cat([scale, low + 8 * scale], dim=-1)  # [N, K/G, 2]
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        return QuantizedWeight(kind, packed, pairs.transpose(0, 1).contiguous().to(weight.dtype), n)
    raise ValueError(f"unknown quantization {kind!r}")
