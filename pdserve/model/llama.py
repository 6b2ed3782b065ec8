"""Llama-family decoder (Llama, Mistral, SmolLM, Qwen2 with q/k/v bias, Qwen3 with q/k norms,
Gemma with its scaled norms and embeddings and GeLU) over a paged KV cache.

Weights are stored fused (q/k/v in one matrix, gate/up in one) for fewer, larger matmuls; each
fused parameter knows how to load its Hugging Face shards (`load_weight`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.model.attention import AttentionMetadata, paged_attention
from pdserve.model.fused import LinearKernel, bf16_linear_kernel, compiled
from pdserve.model.isa import chosen_isa
from pdserve.model.parallel import WHOLE, Collectives, Shard, local_config, vocab_parallel
from pdserve.model.quant import QuantizedWeight, quantize, unsupported
from pdserve.model.rope import apply_rotary, cos_sin_table

log = logging.getLogger(__name__)

LayerDone = Callable[[int], None]
Reduce = Callable[[torch.Tensor], None]  # sums a row-parallel output over the ranks, in place


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if gemma else torch.ones(size))
        self.eps = eps
        self.gemma = gemma  # scale by (1 + weight), in fp32 before the cast (Gemma's order)
        self.ops: Any = None  # the compiled layer ops (csrc/layer_ops.cpp) in bf16, see use_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dim() == 2 and x.is_contiguous():
            return self.ops.rms_norm_bf16(x, self.weight, self.eps)  # type: ignore[no-any-return]  # the compiled op is untyped
        # Same order of operations as Hugging Face: normalise in fp32, cast, then scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def _can_pack(weight: torch.Tensor) -> bool:
    # oneDNN's bf16 path needs AVX512-BF16-era CPUs (or avx_ne_convert); older ones emulate it.
    return (
        weight.dtype == torch.bfloat16
        and chosen_isa().native_bf16
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


@dataclass(frozen=True)
class Bf16Plan:
    """How bf16 linears multiply, by the number of input rows: from `narrow_from` to fewer than
    `narrow_rows` through `kernel` (csrc/bf16_linear.cpp, each weight row read once), from
    `wide_rows` (if set) in fp32 with the weight also held in fp32, the rest in bf16 through
    torch (oneDNN's packed weights where the CPU has native bf16)."""

    kernel: LinearKernel | None
    narrow_from: int
    narrow_rows: int
    wide_rows: int | None


def bf16_plan(dtype: torch.dtype, bf16_matmul: str) -> Bf16Plan | None:
    """The plan for this host's instruction set (isa.py); None: torch's bf16 for every batch.
    "auto" on CPUs without native bf16 multiplies batches in fp32, where torch emulates bf16
    (on an AVX2 EPYC a 512-token SmolLM2 prefill ran at 90 tok/s in bf16 and 518 in fp32), and
    a few rows through the kernel; with native bf16, a few rows through the kernel and the rest
    through oneDNN. "fp32" multiplies in fp32 from one row; "bf16" is torch's bf16 throughout."""
    if dtype != torch.bfloat16 or bf16_matmul == "bf16":
        return None
    kernel = bf16_linear_kernel()
    if bf16_matmul == "fp32":
        return Bf16Plan(None, 0, 0, wide_rows=1)
    if chosen_isa().native_bf16:
        return Bf16Plan(kernel, 1, NATIVE_NARROW_ROWS, None) if kernel is not None else None
    if kernel is None:
        return Bf16Plan(None, 0, 0, wide_rows=WIDE_ROWS_TORCH)
    # one row goes through torch's gemv, as fast as the kernel there
    return Bf16Plan(kernel, 2, WIDE_ROWS, wide_rows=WIDE_ROWS)


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


class Linear(nn.Module):
    """y = x W^T + b. In bf16 on CPU the weight is also kept pre-packed in oneDNN's blocked
    layout where the CPU has native bf16: small-batch (decode) matmuls run ~2x faster than
    through F.linear. A few rows go through the compiled kernel (Bf16Plan). Where bf16 matmuls
    are emulated, the weight is also held in fp32 (`wide`), and inputs of `wide_rows` rows or
    more are multiplied in fp32, then rounded to bf16: products of bf16 values are exact in fp32
    and bf16 kernels accumulate in fp32 too, so only the order of the sums differs. With
    weight-only quantization the weight is replaced by its int8/int4 form (see quant.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
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

    def pack(
        self, quantization: str = "none", keep_weight: bool = False, plan: Bf16Plan | None = None
    ) -> None:
        """Call once the weights are loaded. A quantized layer drops its float weight unless
        `keep_weight` (a weight shared with the embedding); a bf16 layer follows `plan`."""
        if quantization != "none":
            self.quantized = quantize(self.weight, quantization)
            if not keep_weight:
                self.weight = nn.Parameter(self.weight.data.new_empty(0), requires_grad=False)
            return
        if plan is not None and self.weight.dtype == torch.bfloat16:
            self.narrow, self.narrow_from, self.narrow_rows = (
                plan.kernel, plan.narrow_from, plan.narrow_rows
            )  # fmt: skip
            if plan.wide_rows is not None:
                self.wide = self.weight.detach().float()
                self.wide_bias = None if self.bias is None else self.bias.detach().float()
                self.wide_rows = plan.wide_rows
                return
        if _can_pack(self.weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.matmul(x, self.bias)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.narrow is not None and self.narrow_from <= rows < self.narrow_rows:
            out = self.narrow(x.reshape(rows, x.shape[-1]), self.weight, self.bias)
            return out.view(*x.shape[:-1], -1)
        if self.wide is not None and rows >= self.wide_rows:
            return F.linear(x.float(), self.wide, self.wide_bias).to(x.dtype)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """How csrc/decode_layers.cpp takes this layer: (weight, its scales or an empty tensor,
        the bias or an empty tensor, fewer rows than which it may), or None where it cannot."""
        bias = _EMPTY if self.bias is None else self.bias.detach()
        q = self.quantized
        if q is not None:
            return None if q.kernels is None else (q.data, q.scales, bias, _ANY_ROWS)
        if self.narrow is not None and (self.bias is None or bias.dtype == self.weight.dtype):
            return self.weight.detach(), _EMPTY, bias, self.narrow_rows
        if self.weight.dtype == torch.float32 and self.wide is None and self.packed is None:
            return self.weight.detach(), _EMPTY, bias, _ANY_ROWS  # torch's linear, as here
        return None


_EMPTY = torch.empty(0)
_ANY_ROWS = 1 << 30


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


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
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
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.reduce: Reduce | None = None  # tensor parallel: o_proj's partial sums
        self.ops: Any = None  # the compiled layer ops: q and k rotated in place (no q/k norms)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.ops is not None:
            self.ops.rotary_bf16_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos, sin)
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.ops is None:
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = self.o_proj(paged_attention(q, k, v, cache, meta).reshape(t, -1))
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
            out = self.down_proj(self.ops.silu_mul_bf16(gate_up))
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
            out = self.down_proj(act * up)
        if self.reduce is not None:
            self.reduce(out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma_norms)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma_norms)
        self.mlp = MLP(cfg)
        self.ops: Any = None  # the compiled layer ops: each residual add and the norm after it

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), cos, sin, cache, meta)
        if self.ops is None:
            h = h + attn
            return h + self.mlp(self.post_attention_layernorm(h))
        norm = self.post_attention_layernorm
        h, x = self.ops.add_rms_norm_bf16(h, attn, norm.weight, norm.eps)
        return self.ops.add_bf16(h, self.mlp(x))  # type: ignore[no-any-return]  # the compiled op is untyped

    def use_ops(self, ops: Any) -> None:
        """Run the layer's elementwise parts through the compiled ops (csrc/layer_ops.cpp: bf16,
        torch's rounding, one pass each) where this layer's kind allows; None: through torch."""
        attn, mlp = self.self_attn, self.mlp
        self.ops = self.input_layernorm.ops = ops
        attn.ops = ops if attn.q_norm is None else None
        mlp.ops = ops if not mlp.gelu else None


class LlamaModel(nn.Module):
    """Parameter names follow Hugging Face's (`model.layers.N.…`, `lm_head`), fused where noted.
    With a tensor-parallel `shard`, the layers hold that rank's heads and MLP slice (`config` is
    the rank's shapes) and `collectives` joins the ranks."""

    # checkpoint projection name -> (fused module attribute, shard)
    FUSED = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(
        self,
        full: ModelConfig,
        shard: Shard = WHOLE,
        collectives: Collectives | None = None,
    ) -> None:
        super().__init__()
        if shard.world > 1 and collectives is None:
            raise ValueError("a tensor-parallel shard needs its collectives")
        cfg = local_config(full, shard)
        self.config = cfg
        self.shard = shard
        self.collectives = collectives
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers = [DecoderLayer(cfg) for _ in range(cfg.num_layers)]
        if collectives is not None:
            for layer in layers:
                layer.self_attn.reduce = layer.mlp.reduce = collectives.all_reduce
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma_norms)
        # Tied checkpoints share the embedding; lm_head then wraps it (see finish_loading).
        self.vocab_parallel = vocab_parallel(full, shard)
        vocab_rows = cfg.vocab_size // shard.world if self.vocab_parallel else cfg.vocab_size
        self.lm_head = Linear(cfg.hidden_size, vocab_rows, False)
        cos, sin = cos_sin_table(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # decode steps of fewer rows than [1] run their layers in one call (finish_loading)
        self.fused_decode: tuple[list[list[torch.Tensor]], int] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        layer_done: LayerDone | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm. `layer_done(i)` is called once layer
        i has written its K/V into the cache (the prefill node starts sending it then)."""
        h = self.embed_tokens(input_ids)
        if self.config.gemma_norms:  # as Gemma: the scale rounded to the activations' dtype
            h = h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype)
        cos = self.rope_cos[positions].to(h.dtype)
        sin = self.rope_sin[positions].to(h.dtype)
        decode = meta.decode
        fused = self.fused_decode
        if (
            fused is not None
            and layer_done is None
            and not meta.prefills
            and decode is not None
            and decode.kernel is not None
            and h.shape[0] < fused[1]
            and kv_caches[0].dtype == h.dtype
        ):
            cfg = self.config
            h = compiled().decode_layers(
                h, fused[0], cos, sin, kv_caches, meta.slot_blocks, meta.slot_offsets,
                decode.block_tables, decode.lengths, cfg.num_heads, cfg.num_kv_heads,
                cfg.head_dim, cfg.rms_norm_eps,
            )  # fmt: skip
            return self.norm(h)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_caches[i], meta)
            if layer_done is not None:
                layer_done(i)
        return self.norm(h)

    def _fused_decode_args(self) -> tuple[list[list[torch.Tensor]], int] | None:
        """The layers' tensors as csrc/decode_layers.cpp takes them, and fewer rows than which
        it may run a step; None where it cannot run this model (its kernels are not built, a
        layer it does not take, tensor parallelism, Gemma's norms, q/k norms, GeLU, fp16). In
        fp32 it runs the Python path's own operators (bit-identical, see decode_layers.cpp)."""
        cfg = self.config
        if (
            compiled() is None
            or self.collectives is not None
            or cfg.gemma_norms
            or cfg.qk_norm
            or cfg.activation != "silu"
            or self.embed_tokens.weight.dtype not in (torch.bfloat16, torch.float32)
        ):
            return None
        rows = _ANY_ROWS
        layers = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            args = [layer.input_layernorm.weight.detach(),
                    layer.post_attention_layernorm.weight.detach()]  # fmt: skip
            attn, mlp = layer.self_attn, layer.mlp
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                spec = linear.kernel_args()
                if spec is None:
                    return None
                args.extend(spec[:3])
                rows = min(rows, spec[3])
            layers.append(args)
        return layers, rows

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if not self.vocab_parallel:
            return logits
        if not logits.shape[0]:  # nothing sampled this step (every rank knows it)
            return logits.new_empty(0, self.config.vocab_size)
        assert self.collectives is not None
        return self.collectives.all_gather_last(logits)

    def finish_loading(self, quantization: str = "none", bf16_matmul: str = "auto") -> None:
        """Tie the output projection if the config says so, then pack (or quantize, or widen:
        `bf16_matmul`, see wide_rows) weights for inference. The output projection takes int8
        even when the layers take int4: 4-bit logits cost greedy agreement for little speed
        (llama.cpp keeps it wider too)."""
        tied = self.config.tie_word_embeddings
        if tied and self.vocab_parallel:  # this rank's vocabulary rows of the embedding
            rows = self.lm_head.weight.shape[0]
            start = self.shard.rank * rows
            self.lm_head.weight = nn.Parameter(
                self.embed_tokens.weight[start : start + rows], requires_grad=False
            )
        elif tied:
            self.lm_head.weight = self.embed_tokens.weight  # type: ignore[assignment]  # tied: the head shares the embedding's Parameter
        plan = bf16_plan(self.embed_tokens.weight.dtype, bf16_matmul)
        for module in self.modules():
            if isinstance(module, Linear) and module is not self.lm_head:
                module.pack(layer_quantization(module.weight, quantization), plan=plan)
        head = "int8" if quantization != "none" else "none"
        head_quantization = layer_quantization(self.lm_head.weight, head)
        self.lm_head.pack(head_quantization, keep_weight=tied, plan=plan)
        self.fused_decode = self._fused_decode_args()
        ops = compiled() if self.embed_tokens.weight.dtype == torch.bfloat16 else None
        if not self.config.gemma_norms:
            for layer in self.layers:
                assert isinstance(layer, DecoderLayer)
                layer.use_ops(ops)
            self.norm.ops = ops
        if plan is not None:
            linears = [m for m in self.modules() if isinstance(m, Linear)]
            widened = [m.wide for m in linears if m.wide is not None]
            log.info(
                "bf16 linears (%s): %s; %s",
                chosen_isa().name.lower(),
                f"{plan.narrow_from}-{plan.narrow_rows - 1} rows through the compiled kernel"
                if plan.kernel is not None
                else "no compiled kernel",
                f"{plan.wide_rows} rows or more in fp32 (weights also held in fp32: "
                f"{sum(w.numel() * w.element_size() for w in widened) >> 20} MiB more)"
                if plan.wide_rows is not None
                else "more rows in bf16 through oneDNN",
            )

    def load_hf_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Load one tensor named as in a Hugging Face Llama checkpoint."""
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return  # tied: some checkpoints still ship a copy of the embedding
        parts = name.split(".")
        if len(parts) >= 4 and parts[-2] in self.FUSED:
            fused_attr, shard = self.FUSED[parts[-2]]
            parent = self.get_submodule(".".join(parts[:-2]))
            getattr(parent, fused_attr).load_weight(shard, parts[-1], tensor)
            return
        param = self.get_parameter(name)
        if param.shape != tensor.shape:
            raise ValueError(
                f"{name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}"
            )
        param.data.copy_(tensor)


def layer_quantization(weight: torch.Tensor, quantization: str) -> str:
    """`quantization` where the kernels take this weight's shape, else "none" (logged)."""
    if quantization == "none" or (why := unsupported(weight, quantization)) is None:
        return quantization
    log.warning("a %s layer stays unquantized: %s", tuple(weight.shape), why)
    return "none"


def expected_checkpoint_names(cfg: ModelConfig) -> set[str]:
    """The Hugging Face tensor names a complete checkpoint for `cfg` provides."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    for proj in ("q_proj", "k_proj", "v_proj"):
        per_layer.append(f"self_attn.{proj}.weight")
        if cfg.attention_bias:
            per_layer.append(f"self_attn.{proj}.bias")
    if cfg.output_bias:
        per_layer.append("self_attn.o_proj.bias")
    for i in range(cfg.num_layers):
        names.update(f"model.layers.{i}.{p}" for p in per_layer)
    return names
