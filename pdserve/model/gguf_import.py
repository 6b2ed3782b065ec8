"""Converts a llama-family GGUF file into a Hugging Face-style directory that `load_model` reads:
config.json, model.safetensors (dequantized to bf16 or fp32) and the tokenizer files.

GGUF stores the q and k projection rows permuted for llama.cpp's interleaved rope; the
conversion undoes that so the rotate-half rope of Hugging Face checkpoints applies.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from pdserve.model.loader import TORCH_DTYPES

logger = logging.getLogger(__name__)
PROGRESS_EVERY_S = 5.0  # a first run says how far the conversion got

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFImportError(RuntimeError):
    pass


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


# Gemma 3 (llama.cpp's names): attn_norm before attention, post_attention_norm after it,
# ffn_norm before the MLP, post_ffw_norm after it; q/k norms. Its norms are stored as llama.cpp
# multiplies them, 1 + Hugging Face's weight.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
GEMMA3_LOCAL_EVERY = 6  # Gemma 3: five local layers, then a global one (not in its GGUF)
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # its local layers' RoPE base (not in its GGUF)


def hf_config_from_gguf(reader: GGUFReader) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "gemma3"):
        raise GGUFImportError(f"GGUF architecture {arch!r} is not supported (llama, qwen2, gemma3)")
    if arch == "gemma3":
        return _gemma3_config(reader)
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    return {
        "model_type": arch,
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }


def _gemma3_config(reader: GGUFReader) -> dict[str, Any]:
    """Gemma 3's Hugging Face config from its GGUF, what the GGUF leaves out as Gemma 3's own
    config has it (and transformers' GGUF loader assumes): the layer pattern, the local RoPE
    base, query_pre_attn_scalar = head_dim."""
    heads = int(_field(reader, "gemma3.attention.head_count"))
    layers = int(_field(reader, "gemma3.block_count"))
    head_dim = int(_field(reader, "gemma3.attention.key_length"))
    theta = float(_field(reader, "gemma3.rope.freq_base", 1e6))
    names = {t.name for t in reader.tensors}
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")),
        "hidden_size": int(_field(reader, "gemma3.embedding_length")),
        "intermediate_size": int(_field(reader, "gemma3.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "gemma3.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "rms_norm_eps": float(_field(reader, "gemma3.attention.layer_norm_rms_epsilon")),
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA},
        },
        "sliding_window": int(_field(reader, "gemma3.attention.sliding_window")),
        "layer_types": [
            "full_attention" if (i + 1) % GEMMA3_LOCAL_EVERY == 0 else "sliding_attention"
            for i in range(layers)
        ],
        "max_position_embeddings": int(_field(reader, "gemma3.context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_activation": "gelu_pytorch_tanh",
    }


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation (pairs of rope halves interleaved per head)."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _hf_name(gguf_name: str, arch: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = _GEMMA3_LAYER_NAMES if arch == "gemma3_text" else _LAYER_NAMES
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"
    return None


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str) -> Path:
    """Writes the converted directory atomically (a temp dir renamed into place)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(str(gguf_path))
    config = hf_config_from_gguf(reader)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    total = len(reader.tensors)
    started = last_report = time.monotonic()
    logger.warning("converting %s to %s (%d tensors, once)", gguf_path.name, dtype, total)
    for i, t in enumerate(reader.tensors, 1):
        if time.monotonic() - last_report >= PROGRESS_EVERY_S:
            last_report = time.monotonic()
            logger.warning("converting %s: %d/%d tensors", gguf_path.name, i - 1, total)
        name = _hf_name(t.name, config["model_type"])
        if name is None:
            logger.info("skipping GGUF tensor %s", t.name)
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        if config["model_type"] == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute_rows(w, config["num_attention_heads"])
        elif config["model_type"] == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute_rows(w, config["num_key_value_heads"])
        elif config["model_type"] == "gemma3_text" and t.name.endswith("norm.weight"):
            w = w - 1.0
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w)).to(TORCH_DTYPES[dtype])
    save_file(tensors, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(gguf_path, tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    logger.warning(
        "converted %s in %.0f s into %s", gguf_path.name, time.monotonic() - started, out_dir
    )
    return out_dir


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    # transformers rebuilds the tokenizer (vocab, merges, pre-tokenizer, chat template) from
    # the GGUF metadata; its saved files make later loads independent of the GGUF.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))
