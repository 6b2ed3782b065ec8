"""`--model org/name` through huggingface_hub, against a hub cache laid out by the test (no
network: HF_HUB_OFFLINE=1). The generated text is compared with transformers on the same
snapshot; `--revision` picks another snapshot; a model missing offline is a clear error."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers import make_tiny_model

REPO = "acme/tiny-llama"
MAIN = "a" * 40
V2 = "b" * 40
PROMPT = "t5 t9 t17 t33"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models--acme--tiny-llama with two snapshots: main, and the tag v2 (a different model)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--acme--tiny-llama"
    make_tiny_model(repo / "snapshots" / MAIN)
    make_tiny_model(repo / "snapshots" / V2, num_hidden_layers=2, initializer_range=0.5)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(V2)
    return cache


def generate(hub: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--dtype", "float32",
           "--max-tokens", "6", "--temperature", "0", "--no-chat", *args, PROMPT]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def reference(snapshot: Path) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(snapshot))
    model = AutoModelForCausalLM.from_pretrained(str(snapshot), dtype=torch.float32)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None,
                             pad_token_id=0)  # fmt: skip
    return str(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def generated_text(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    return lines[lines.index(f"--- {PROMPT}") + 1]


def test_hub_id_resolves_through_the_hub_cache_and_revision_pins_a_snapshot(hub: Path) -> None:
    snapshots = hub / "models--acme--tiny-llama" / "snapshots"
    main, v2 = reference(snapshots / MAIN), reference(snapshots / V2)
    assert main != v2  # the two snapshots are different models
    runs = [("--model", REPO), ("--model", REPO, "--revision", "v2"),
            ("--model", REPO, "--revision", V2)]  # fmt: skip
    with ThreadPoolExecutor(len(runs)) as pool:  # the three processes at once
        texts = list(pool.map(lambda args: generated_text(generate(hub, *args)), runs))
    assert texts == [main, v2, v2]


def test_a_hub_model_missing_offline_is_a_clear_error(hub: Path) -> None:
    proc = generate(hub, "--model", "acme/not-there")
    assert proc.returncode == 2
    assert "acme/not-there is not in the hub cache" in proc.stderr
    assert "HF_HUB_OFFLINE is set" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_takes_a_hub_id_and_names_itself_by_it(hub: Path) -> None:
    import httpx

    from tests.disagg.cluster import free_port

    port = free_port()
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--role", "both", "--model", REPO,
           "--dtype", "float32", "--threads", "1", "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not start"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == REPO
        body = {"model": REPO, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        snapshot = hub / "models--acme--tiny-llama" / "snapshots" / MAIN
        assert r.json()["choices"][0]["text"] == reference(snapshot)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
