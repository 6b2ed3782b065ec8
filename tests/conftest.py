from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import THREADS, cache_dir

torch.set_num_threads(THREADS)  # transformers' references too


@pytest.fixture(scope="session")
def smollm_fp32_dir() -> Path:
    from pdserve.model.fetch import resolve_model

    return resolve_model("default", cache_dir(), "float32")


@pytest.fixture(scope="session")
def smollm_bf16_dir() -> Path:
    from pdserve.model.fetch import resolve_model

    return resolve_model("default", cache_dir(), "bfloat16")


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    from pdserve.model.fetch import fetch_default_gguf

    return fetch_default_gguf(cache_dir())


@pytest.fixture(scope="session")
def hf_smollm(smollm_gguf: Path):  # type: ignore[no-untyped-def]
    """transformers' own GGUF loader (its own dequantization): the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm_gguf.parent), gguf_file=smollm_gguf.name, dtype=torch.float32
    )
    return model.eval()
