"""The engine's configuration: the model (read from its config.json), the KV cache, the
scheduler, and the engine that holds them; the served model's name and the model cache."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.config.defaults import (
    ACTIVATIONS,
    ATTENTION_BACKENDS,
    BF16_MATMULS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DTYPE,
    DEFAULT_KV_CACHE_MIB,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MODEL,
    DEFAULT_MODEL_NAME,
    DTYPES,
    MIB,
    QUANTIZATIONS,
    SUPPORTED_ARCHITECTURES,
    ConfigError,
)

__all__ = [
    "RopeScaling",
    "ModelConfig",
    "CacheConfig",
    "SchedulerConfig",
    "EngineConfig",
    "served_model_name",
    "default_cache_dir",
]


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (the only scaling kind pdserve implements)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    activation: str = "silu"  # of the MLP's gate (Gemma: gelu_pytorch_tanh)
    gemma_norms: bool = False  # Gemma: norms scale by (1 + weight), embeddings by sqrt(hidden)
    # Gemma 3: a norm after attention and after the MLP too (four per layer)
    sandwich_norms: bool = False
    query_scale: float | None = None  # attention's scale where not head_dim ** -0.5 (Gemma 3)
    # Layers of sliding-window attention (Gemma 3's local layers, Mistral's, Qwen's from
    # max_window_layers on), their window (a query sees its last `sliding_window` positions,
    # itself included) and RoPE base where it differs (Gemma 3)
    local_layers: tuple[int, ...] = ()
    sliding_window: int | None = None
    local_rope_theta: float | None = None

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window; None where it attends to the whole context."""
        return self.sliding_window if layer in self.local_layers else None

    @property
    def output_bias(self) -> bool:
        """Llama's attention_bias covers o_proj too; Qwen2 biases q/k/v only."""
        return self.attention_bias and self.architecture != "qwen2"

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        arch = str(d.get("model_type", "llama"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"model_type {arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})"
            )
        rope = d.get("rope_parameters") or {}
        local_rope = None
        if "full_attention" in rope:  # Gemma 3: a RoPE per kind of layer
            local_rope = rope.get("sliding_attention") or {}
            rope = rope["full_attention"] or {}
        for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
            if d.get(cap) is not None:
                raise ConfigError(f"{cap} is not supported (Gemma 2's)")
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else None)
        rope_scaling = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                rope_scaling = RopeScaling(
                    factor=float(scaling["factor"]),
                    low_freq_factor=float(scaling["low_freq_factor"]),
                    high_freq_factor=float(scaling["high_freq_factor"]),
                    original_max_position=int(scaling["original_max_position_embeddings"]),
                )
            elif kind not in (None, "default"):
                raise ConfigError(f"rope scaling {kind!r} is not supported (only llama3)")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        max_position = int(d.get("max_position_embeddings", 4096))
        activation = str(d.get("hidden_activation") or d.get("hidden_act") or "silu")
        if activation not in ACTIVATIONS:
            raise ConfigError(f"activation {activation!r} is not supported ({ACTIVATIONS})")
        window = d.get("sliding_window")
        if arch in ("qwen2", "qwen3") and not d.get("use_sliding_window"):
            window = None  # as transformers' Qwen configs: declared, not used
        num_layers = int(d["num_hidden_layers"])
        layer_types = list(d.get("layer_types") or [])
        if not layer_types:  # as transformers derives them
            if arch == "gemma3_text":  # older configs: every Nth layer global
                every = int(d.get("sliding_window_pattern", 6))
                layer_types = [
                    "full_attention" if (i + 1) % every == 0 else "sliding_attention"
                    for i in range(num_layers)
                ]
            elif arch in ("qwen2", "qwen3"):
                first = int(d.get("max_window_layers", num_layers))
                layer_types = [
                    "sliding_attention" if i >= first else "full_attention"
                    for i in range(num_layers)
                ]
            elif arch == "mistral":
                layer_types = ["sliding_attention"] * num_layers
        local_layers: tuple[int, ...] = ()
        if window:
            local_layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position=max_position,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", arch.startswith("gemma"))),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rope_scaling=rope_scaling,
            qk_norm=arch in ("qwen3", "gemma3_text"),
            activation=activation,
            gemma_norms=arch in ("gemma", "gemma3_text"),
            sandwich_norms=arch == "gemma3_text",
            query_scale=None
            if d.get("query_pre_attn_scalar") is None
            else float(d["query_pre_attn_scalar"]) ** -0.5,
            local_layers=local_layers,
            sliding_window=int(window) if window and local_layers else None,
            local_rope_theta=None
            if arch != "gemma3_text"
            else float((local_rope or {}).get("rope_theta", d.get("rope_local_base_freq", 1e4))),
        )

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir} has no config.json")
        return cls.from_hf_dict(json.loads(path.read_text()))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    # Total bytes for the paged KV cache across all layers; ignored when num_blocks is set.
    kv_cache_memory: int = DEFAULT_KV_CACHE_MIB * MIB
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    # What cache keys are keyed with (derived from the cluster secret; never printed).
    hash_key: bytes = field(default=b"", repr=False)
    # Models with sliding-window layers: the memory of those layers' blocks behind every
    # request's window goes back (engine/kv_cache.py); off where a NIXL agent has the memory
    # registered (an RDMA NIC may have it pinned).
    window_memory: bool = True
    # With num_blocks: how many blocks' windowed-layer parts fit (None: as many as blocks).
    num_window_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.num_window_blocks is not None and self.num_window_blocks < 1:
            raise ConfigError(f"num_window_blocks must be >= 1, got {self.num_window_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None  # None: the model's max_position
    # No new prompt joins a step once it holds this many prompt tokens (None: only the budget
    # limits them; a prefill node takes DEFAULT_PREFILL_STEP_TOKENS then).
    prefill_step_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.prefill_step_tokens is not None and self.prefill_step_tokens < 1:
            raise ConfigError("prefill_step_tokens must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = DEFAULT_DTYPE
    num_threads: int | None = None
    cache_dir: str | None = None  # None: $PDSERVE_CACHE or ~/.cache/pdserve, resolved by the CLI
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # "auto": decode attention through the compiled kernel where it builds; "torch": never.
    attention_backend: str = "auto"
    quantization: str = "none"
    revision: str | None = None  # a hub model's branch, tag or commit
    tensor_parallel_size: int = 1  # ranks (processes) the model is sharded over
    # "auto": the layers through the compiled panel kernels (AVX2, AVX512 builds; the output
    # projection's batches in fp32 where bf16 is emulated), oneDNN's bf16 on AMX (linear_plan).
    # "bf16" or "fp32": always so.
    bf16_matmul: str = "auto"
    # Every reduction in an order fixed by the row and position, never by the batch: output
    # (tokens and logprobs) bit-identical alone or batched, chunked, preempted, cached or not,
    # prefilled here or on a peer (model/linear.py, model/attention.py).
    deterministic: bool = False
    # The fraction of completed greedy or seeded requests recomputed when the engine is idle
    # and compared with what was served (engine/canary.py); 0: none.
    canary_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor-parallel size must be >= 1, got {self.tensor_parallel_size}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.quantization != "none" and self.dtype != "bfloat16":
            # torch's weight-only CPU kernels are vectorized for bf16 activations; with fp32
            # ones a 512-token prefill ran 25x slower than without quantization.
            raise ConfigError(f"--quantization {self.quantization} needs --dtype bfloat16")
        if self.bf16_matmul not in BF16_MATMULS:
            raise ConfigError(
                f"--bf16-matmul must be one of {BF16_MATMULS}, got {self.bf16_matmul!r}"
            )
        if not 0.0 <= self.canary_rate <= 1.0:
            raise ConfigError(f"--canary-rate must be in [0, 1], got {self.canary_rate}")
        if self.deterministic and self.quantization != "none":
            raise ConfigError("--deterministic takes unquantized weights (no --quantization yet)")
        if self.deterministic and self.tensor_parallel_size > 1:
            # The ranks' partial sums meet in gloo's all-reduce, whose order is gloo's own.
            raise ConfigError("--deterministic runs on one rank (no --tensor-parallel-size yet)")
        if self.deterministic and self.attention_backend != "auto":
            raise ConfigError(
                "--deterministic needs the compiled attention (--attention-backend auto)"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )


def served_model_name(model: str, override: str | None = None) -> str:
    """The model name clients send: `override`, else derived from `--model`."""
    if override:
        return override
    if model == DEFAULT_MODEL:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    if path.suffix == ".gguf":
        return path.stem
    return path.name if path.expanduser().exists() else model  # a hub id names itself


def default_cache_dir() -> Path:
    """The model cache: $PDSERVE_CACHE, else ~/.cache/pdserve. Called at the CLI edge only."""
    env = os.environ.get("PDSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pdserve"
