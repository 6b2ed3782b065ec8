"""`pdserve top` over a real fleet (a router, a decode and a prefill node on loopback, tiny
model): after some disaggregated requests its view names both nodes with their roles as
routed, the decode's KV use and prefix hit rate as the decode itself reports them, its KV
bytes as the prompts' KV by the model's shape, a rate once two samples are apart; the prefill
node as the router sees it; and the command prints that screen (`--once`)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.router.top import Top, parse_metrics, render, value
from tests.helpers import logs_kept_on_failure, make_tiny_model
from tests.router.test_router_e2e import Proc, start_pd_fleet

pytestmark = pytest.mark.slow

MODEL = "tiny"
BLOCK = 16


@pytest.fixture
def fleet(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Path, list[str]]]:
    model = make_tiny_model(tmp_path / "tiny")
    procs: list[Proc] = []
    with logs_kept_on_failure(request, lambda: [p.log for p in procs]):
        try:
            router, decode, prefill = start_pd_fleet(procs, model)
            yield model, [router, decode, prefill]
        finally:
            for p in reversed(procs):
                p.stop()


def test_top_shows_each_node_as_it_reports_itself(fleet: tuple[Path, list[str]]) -> None:
    model, (router, decode, prefill) = fleet
    top = Top(router)
    try:
        first = top.sample()
        prompts = [[3 + (5 * i + j) % 200 for j in range(40 + 8 * i)] for i in range(3)]
        for prompt in prompts:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
            r = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        own = parse_metrics(httpx.get(f"{decode}/metrics", timeout=10).text)
        view = top.sample()
    finally:
        top.close()
    rows = {r.name: r for r in view.rows}
    assert set(rows) == {decode, prefill} and rows[decode].role == "decode"
    assert rows[prefill].role == "prefill" and rows[prefill].routed and rows[decode].routed
    assert first.rows and first.rows[0].gb_per_s is None  # no rate from one sample
    d = rows[decode]
    assert d.kv_usage == value(own, "vllm:kv_cache_usage_perc")
    assert d.hit_rate == value(own, "pdserve:prefix_cache_hit_rate")
    assert d.running == 0 and d.waiting == 0  # every request answered
    config = json.loads((model / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_block = (
        2 * config["num_key_value_heads"] * BLOCK * head_dim * 4 * config["num_hidden_layers"]
    )
    kv_bytes = sum(math.ceil(len(p) / BLOCK) * per_block for p in prompts)
    assert d.transfer_bytes == kv_bytes  # received: every prompt's KV, as its shape says
    assert d.gb_per_s is not None and d.gb_per_s > 0
    assert view.requests_routed == 3
    screen = render(view)
    assert decode in screen and prefill in screen

    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "top", "--router", router, "--once"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"pdserve top  {router}") and "routed 3" in lines[0]
    assert any(line.startswith(decode) and " decode " in line for line in lines)
    assert any(line.startswith(prefill) and " prefill " in line for line in lines)
