from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import THREADS, cache_dir, live_logs, log_tails

torch.set_num_threads(THREADS)  # transformers' references too


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """A failing test's report carries the tails of the logs of the servers running for it
    (a module's fixtures): CI shows the report, not the temp directory."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and live_logs:
        report.sections.append(
            ("server logs", "\n".join(log_tails(logs()) for logs in list(live_logs)))
        )


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
