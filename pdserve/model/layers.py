"""A decoder layer of the Llama family and its parts: RMSNorm (Gemma's scaled form too), attention
over the paged KV cache (q/k/v fused, q/k norms, rotary), the MLP (SiLU or GeLU), each with
its elementwise parts through the compiled layer ops (bf16, float32) where the layer's kind allows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.model.attention import AttentionMetadata, paged_attention
from pdserve.model.linear import FusedLinear, Linear, Reduce
from pdserve.model.rope import apply_rotary

LayerDone = Callable[[int], None]  # told when a layer's KV is written (the transfer hook)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if gemma else torch.ones(size))
        self.eps = eps
        self.gemma = gemma  # scale by (1 + weight), in fp32 before the cast (Gemma's order)
        self.ops: Any = None  # the compiled layer ops (csrc/layer_ops.cpp), see use_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dim() == 2 and x.is_contiguous():
            return self.ops.rms_norm(x, self.weight, self.eps)  # type: ignore[no-any-return]  # the compiled op is untyped
        # Same order of operations as Hugging Face: normalise in fp32, cast, then scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.window = window  # sliding-window attention over this many positions; None: all
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_rows = cfg.num_heads * cfg.head_dim
        kv_rows = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = FusedLinear(
            cfg.hidden_size, {"q": q_rows, "k": kv_rows, "v": kv_rows}, cfg.attention_bias
        )
        self.o_proj = Linear(q_rows, cfg.hidden_size, bias=cfg.output_bias)
        self.split = (q_rows, kv_rows, kv_rows)
        norm = cfg.head_dim, cfg.rms_norm_eps, cfg.gemma_norms
        self.q_norm = RMSNorm(*norm) if cfg.qk_norm else None
        self.k_norm = RMSNorm(*norm) if cfg.qk_norm else None
        # The kernels scale scores by head_dim ** -0.5: another scale is put into q (Gemma 3)
        scale = cfg.query_scale
        same = scale is None or scale == cfg.head_dim**-0.5
        self.q_scale = None if same else scale * cfg.head_dim**0.5
        self.reduce: Reduce | None = None  # tensor parallel: o_proj's partial sums
        self.ops: Any = None  # the compiled layer ops: q and k rotated in place (no q/k norms)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every row's K/V goes into the cache; the output is of the rows `keep` names (all
        where it is None)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.ops is not None:
            self.ops.rotary_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos, sin)
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.ops is None:
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        if self.q_scale is not None:
            q = q * self.q_scale
        v = v.view(t, self.num_kv_heads, self.head_dim)
        heads = paged_attention(q, k, v, cache, meta, self.window).reshape(t, -1)
        if keep is not None:
            heads = heads[keep]
        out = self.o_proj(heads)
        if self.reduce is not None:
            self.reduce(out)
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.intermediate_size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate": n, "up": n}, bias=False)
        self.down_proj = Linear(n, cfg.hidden_size, bias=False)
        self.intermediate = n
        self.gelu = cfg.activation == "gelu_pytorch_tanh"
        self.reduce: Reduce | None = None  # tensor parallel: down_proj's partial sums
        self.ops: Any = None  # the compiled layer ops: SiLU(gate) * up in one pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None:
            out = self.down_proj(self.ops.silu_mul(gate_up))
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
            out = self.down_proj(act * up)
        if self.reduce is not None:
            self.reduce(out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma_norms)
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma_norms)
        self.mlp = MLP(cfg)
        # Gemma 3: post_attention_layernorm normalises attention's output, these the MLP's
        # input and output
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, True)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, True)
        self.ops: Any = None  # the compiled layer ops: each residual add and the norm after it

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output for the rows `keep` names (all where it is None); every row's
        K/V is written. Each row's output depends on its own inputs and its attention alone,
        so a kept row is the one the whole batch would give: the same bits where the linears
        compute rows apart (the panel kernels of AVX2 and AVX512 builds), within rounding where
        torch's matmuls take them (a generic build)."""
        attn = self.self_attn(self.input_layernorm(h), cos, sin, cache, meta, keep)
        if keep is not None:
            h = h[keep]
        if self.pre_feedforward_layernorm is not None:
            assert self.post_feedforward_layernorm is not None
            h = h + self.post_attention_layernorm(attn)
            mlp = self.mlp(self.pre_feedforward_layernorm(h))
            return h + self.post_feedforward_layernorm(mlp)
        if self.ops is None:
            h = h + attn
            return h + self.mlp(self.post_attention_layernorm(h))
        norm = self.post_attention_layernorm
        h, x = self.ops.add_rms_norm(h, attn, norm.weight, norm.eps)
        return self.ops.add_rows(h, self.mlp(x))  # type: ignore[no-any-return]  # the compiled op is untyped

    def use_ops(self, ops: Any) -> None:
        """Run the layer's elementwise parts through the compiled ops (csrc/layer_ops.cpp: bf16 or
        float32, torch's rounding, one pass each) where this layer's kind allows; None: through
        torch."""
        attn, mlp = self.self_attn, self.mlp
        self.ops = self.input_layernorm.ops = ops
        attn.ops = ops if attn.q_norm is None else None
        mlp.ops = ops if not mlp.gelu else None
