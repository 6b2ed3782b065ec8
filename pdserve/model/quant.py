"""Weight-only quantization of linear layers through torch's CPU kernels: `int8` keeps one scale
per output row (symmetric); `int4` keeps a scale and a minimum per group of 32 inputs (the layout
of GGUF's Q4_1, so the bundled model's 4-bit weights map onto it closely). Activations stay in the
model's dtype; only the weights shrink, which is what bounds small-batch decode on CPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP = 32


@dataclass(frozen=True)
class QuantizedWeight:
    kind: str  # "int8" or "int4"
    data: torch.Tensor  # int8: [N, K] int8; int4: torch's packed layout
    scales: torch.Tensor  # int8: [N]; int4: [K / INT4_GROUP, N, 2] (scale, zero) pairs
    out_features: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] in the model's dtype -> x @ W^T [..., N] with W the dequantized weight."""
        flat = x.reshape(-1, x.shape[-1])
        if self.kind == "int8":
            y = torch._weight_int8pack_mm(flat, self.data, self.scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(flat, self.data, INT4_GROUP, self.scales)
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
    """Quantize a [N, K] weight; the kernels compute in the weight's dtype."""
    if (why := unsupported(weight, kind)) is not None:
        raise ValueError(why)
    w = weight.detach().float()
    n, k = w.shape
    if kind == "int8":
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(kind, q.contiguous(), scale.to(weight.dtype), n)
    if kind == "int4":
        groups = w.reshape(n, k // INT4_GROUP, INT4_GROUP)
        low = groups.amin(dim=-1, keepdim=True)
        scale = ((groups.amax(dim=-1, keepdim=True) - low) / 15).clamp(
            min=torch.finfo(torch.float32).tiny
        )
        q = torch.round((groups - low) / scale).clamp(0, 15).to(torch.int32).reshape(n, k)
        # torch's kernel computes (q - 8) * scale + zero, so zero = low + 8 * scale.
        pairs = torch.cat([scale, low + 8 * scale], dim=-1)  # [N, K/G, 2]
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        return QuantizedWeight(kind, packed, pairs.transpose(0, 1).contiguous().to(weight.dtype), n)
    raise ValueError(f"unknown quantization {kind!r}")
