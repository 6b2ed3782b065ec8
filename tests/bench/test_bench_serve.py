"""`pdserve bench serve` drives an OpenAI-compatible server it knows nothing about, behind an
API key it is given: here our colocated server under another port and model name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.stats import RequestRecord, summarize
from tests.api.test_openai_api import Server

pytestmark = pytest.mark.slow


def test_bench_serve_against_another_server(tmp_path: Path) -> None:
    key = "sk-bench-only-key"
    server = Server(
        ["--role", "both", "--served-model-name", "someone-elses-model", "--api-key", key]
    )
    try:
        out = tmp_path / "bench.json"
        proc = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", server.url,
             "--model", "someone-elses-model", "--num-prompts", "6", "--input-len", "40",
             "--output-len", "8", "--request-rate", "20", "--no-progress", "--out", str(out),
             "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--api-key", key],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert key not in out.read_text()  # the key is sent, never recorded
        result = json.loads(out.read_text())
    finally:
        server.stop()
    records = [
        RequestRecord(**{k: v for k, v in r.items() if k != "tpot"}) for r in result["requests"]
    ]
    assert len(records) == 6 and all(r.ok for r in records)
    assert all(r.output_tokens == 8 and r.prompt_tokens == 40 for r in records)
    assert all(r.ttft is not None and r.e2e is not None and r.e2e >= r.ttft for r in records)
    # The report is the arithmetic of the recorded requests, nothing else.
    recomputed = summarize(records, result["summary"]["duration_s"], 60.0, 60.0)
    for key in ("output_token_throughput", "goodput", "ttft_ms", "itl_ms", "e2e_ms"):
        assert recomputed[key] == result["summary"][key], key
    assert result["summary"]["goodput"] == pytest.approx(6 / result["summary"]["duration_s"])
