"""Llama-family decoder (Llama, Mistral, SmolLM, Qwen2 with q/k/v bias, Qwen3 with q/k norms,
Gemma with its scaled norms and embeddings and GeLU, Gemma 3 with four norms a layer, q/k norms,
its query scale and a RoPE base of its own for the local layers) over a paged KV cache.

Weights are stored fused (q/k/v in one matrix, gate/up in one) for fewer, larger matmuls; each
fused parameter knows how to load its Hugging Face shards (`load_weight`).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from pdserve.config import ModelConfig
from pdserve.model.attention import AttentionMetadata
from pdserve.model.fused import compiled
from pdserve.model.hugepages import move_to_huge_pages
from pdserve.model.isa import chosen_isa
from pdserve.model.layers import DecoderLayer, LayerDone, RMSNorm
from pdserve.model.linear import ANY_ROWS, Linear, layer_quantization, linear_plan
from pdserve.model.parallel import WHOLE, Collectives, Shard, local_config, vocab_parallel
from pdserve.model.quant import QuantizedWeight
from pdserve.model.rope import cos_sin_table

log = logging.getLogger(__name__)


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
        layers = [DecoderLayer(cfg, cfg.layer_window(i)) for i in range(cfg.num_layers)]
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
        # Gemma 3's local (sliding-window) layers rotate with another base
        self.local_layers = frozenset(cfg.local_layers if cfg.local_rope_theta else ())
        self.local_rope: tuple[torch.Tensor, torch.Tensor] | None = None
        if cfg.local_rope_theta is not None:
            self.local_rope = cos_sin_table(cfg.head_dim, cfg.local_rope_theta, None,
                                            cfg.max_position)  # fmt: skip
        # decode steps of fewer rows than [1] run their layers in one call (finish_loading)
        self.fused_decode: tuple[list[list[torch.Tensor]], int, int] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        layer_done: LayerDone | None = None,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm: [T, hidden], or of the rows `keep` names (those
        the caller samples), in its order. With `keep` the last layer writes every row's K/V but
        computes the output projection and MLP of the kept rows only: a prompt's other
        positions need nothing more there (SmolLM2: 2.8% of a prompt's linear FLOPs).
        `layer_done(i)` is called once layer i has written its K/V into the cache (the prefill
        node starts sending it then)."""
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
                cfg.head_dim, cfg.rms_norm_eps, decode.exact, fused[2],
            )  # fmt: skip
            return self.norm(h if keep is None else h[keep])
        local = None
        if self.local_rope is not None:
            local = (self.local_rope[0][positions].to(h.dtype),
                     self.local_rope[1][positions].to(h.dtype))  # fmt: skip
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            rows = keep if i == last else None
            if local is not None and i in self.local_layers:
                h = layer(h, *local, kv_caches[i], meta, rows)
            else:
                h = layer(h, cos, sin, kv_caches[i], meta, rows)
            if layer_done is not None:
                layer_done(i)
        return self.norm(h)

    def _held_tensors(self) -> list[torch.Tensor]:
        """Every tensor the modules hold (parameters, buffers, packed or quantized weights), in
        the modules' order: the order a forward pass reads them."""
        held: list[torch.Tensor] = []
        for module in self.modules():
            held.extend(module.parameters(recurse=False))
            held.extend(module.buffers(recurse=False))
            for value in vars(module).values():
                if isinstance(value, torch.Tensor):
                    held.append(value)
                elif isinstance(value, QuantizedWeight):
                    held.extend((value.data, value.scales))
        return held

    def _fused_decode_args(self) -> tuple[list[list[torch.Tensor]], int, int] | None:
        """The layers' tensors as csrc/decode_layers.cpp takes them, fewer rows than which it
        may run a step, and the rows from which its linears take their oneDNN-packed weights
        (as Linear.forward does; AMX hosts); None where it cannot run this model (its kernels
        are not built, a layer it does not take, tensor parallelism, Gemma's norms, q/k norms,
        GeLU, sliding windows, fp16). In fp32 it runs the Python path's own operators
        (bit-identical, see decode_layers.cpp)."""
        cfg = self.config
        if (
            compiled() is None
            or self.collectives is not None
            or cfg.gemma_norms
            or cfg.qk_norm
            or cfg.activation != "silu"
            or cfg.local_layers
            or self.embed_tokens.weight.dtype not in (torch.bfloat16, torch.float32)
        ):
            return None
        rows = packed_from = ANY_ROWS
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
                if spec[1].is_mkldnn:
                    packed_from = min(packed_from, linear.narrow_rows)
            layers.append(args)
        return layers, rows, packed_from

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if not self.vocab_parallel:
            return logits
        if not logits.shape[0]:  # nothing sampled this step (every rank knows it)
            return logits.new_empty(0, self.config.vocab_size)
        assert self.collectives is not None
        return self.collectives.all_gather_last(logits)

    def finish_loading(
        self, quantization: str = "none", bf16_matmul: str = "auto", deterministic: bool = False
    ) -> None:
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
        plan = linear_plan(self.embed_tokens.weight.dtype, bf16_matmul, deterministic)
        for module in self.modules():
            if isinstance(module, Linear) and module is not self.lm_head:
                module.pack(layer_quantization(module.weight, quantization), plan=plan)
        head = "int8" if quantization != "none" else "none"
        head_quantization = layer_quantization(self.lm_head.weight, head)
        # The head keeps the row kernel (a row per sequence; its weight may be the embedding's),
        # but takes the AMX tiles where the layers do (--deterministic on AMX: each row its own
        # sums there too; SmolLM2's head at 16 rows 1.5 ms against the row kernel's 8.5, at one
        # row 1.4 against 1.1)
        head_plan = plan if plan is None or plan.tiles else dataclasses.replace(plan, blocked=None)
        self.lm_head.pack(head_quantization, keep_weight=tied, plan=head_plan)
        move_to_huge_pages(self._held_tensors())  # before anything takes aliases of them
        self.fused_decode = self._fused_decode_args()
        ops = (
            compiled()
            if self.embed_tokens.weight.dtype in (torch.bfloat16, torch.float32)
            else None
        )
        if not self.config.gemma_norms:
            for layer in self.layers:
                assert isinstance(layer, DecoderLayer)
                layer.use_ops(ops)
            self.norm.ops = ops
        if plan is not None:
            linears = [m for m in self.modules() if isinstance(m, Linear)]
            widened = [m.wide for m in linears if m.wide is not None]
            log.info(
                "%s linears (%s): %s; %s",
                "fp32" if plan.dtype == torch.float32 else "bf16",
                chosen_isa().name.lower(),
                "every row of the layers and the output projection on the AMX tiles"
                if plan.tiles
                else "every row of the layers through the panel kernel"
                if plan.blocked is not None
                else f"{plan.narrow_from}-{plan.narrow_rows - 1} rows through the compiled kernel"
                if plan.kernel is not None
                else "no compiled kernel",
                f"{plan.wide_rows} rows or more in fp32 (weights also held in fp32: "
                f"{sum(w.numel() * w.element_size() for w in widened) >> 20} MiB more)"
                if plan.wide_rows is not None
                else "more rows through torch",
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
    if cfg.sandwich_norms:
        per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    if cfg.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for proj in ("q_proj", "k_proj", "v_proj"):
        per_layer.append(f"self_attn.{proj}.weight")
        if cfg.attention_bias:
            per_layer.append(f"self_attn.{proj}.bias")
    if cfg.output_bias:
        per_layer.append("self_attn.o_proj.bias")
    for i in range(cfg.num_layers):
        names.update(f"model.layers.{i}.{p}" for p in per_layer)
    return names
