"""Builds a LlamaModel from a Hugging Face-style directory (config.json + *.safetensors)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.config import ModelConfig
from pdserve.model.llama import LlamaModel, expected_checkpoint_names
from pdserve.model.parallel import WHOLE, Collectives, Shard, shard_tensor

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class WeightLoadError(RuntimeError):
    """The checkpoint does not match the model it is loaded into."""


def load_model(
    model_dir: str | Path,
    dtype: str,
    quantization: str = "none",
    shard: Shard = WHOLE,
    collectives: Collectives | None = None,
    bf16_matmul: str = "auto",
    deterministic: bool = False,
) -> LlamaModel:
    """The model, or with a tensor-parallel `shard` this rank's part of it (each tensor sliced
    as it is read)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{model_dir} has no *.safetensors files")
    torch_dtype = TORCH_DTYPES[dtype]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.no_grad():
            model = LlamaModel(cfg, shard, collectives)
    finally:
        torch.set_default_dtype(previous)
    seen: set[str] = set()
    with torch.no_grad():
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    tensor = shard_tensor(name, f.get_tensor(name), cfg, shard)
                    model.load_hf_tensor(name, tensor.to(torch_dtype))
                    seen.add(name)
    missing = expected_checkpoint_names(cfg) - seen
    if missing:
        raise WeightLoadError(f"{model_dir}: checkpoint lacks {sorted(missing)[:5]} ...")
    model.finish_loading(quantization, bf16_matmul, deterministic)
    model.eval()
    logger.info(
        "loaded %s (%d layers, %s, weights %s%s) from %s",
        cfg.architecture,
        cfg.num_layers,
        dtype,
        quantization,
        f", tensor-parallel rank {shard.rank} of {shard.world}" if shard.world > 1 else "",
        model_dir,
    )
    return model
