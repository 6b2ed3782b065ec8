"""Benchmark arithmetic on fixed inputs: percentiles, goodput, TPOT and the TTFT breakdown."""

from __future__ import annotations

import math

import pytest

from pdserve.api.timing import ttft_breakdown
from pdserve.bench.stats import RequestRecord, goodput, percentile, summarize


def test_percentile_interpolates_between_ranks() -> None:
    xs = [10.0, 20.0, 30.0, 40.0]
    assert percentile(xs, 50) == 25.0  # halfway between 20 and 30
    assert percentile(xs, 90) == pytest.approx(37.0)  # rank 2.7
    assert percentile(xs, 99) == pytest.approx(39.7)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0  # order of input does not matter


def rec(ttft: float, e2e: float, tokens: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(start=0.0, ok=ok, ttft=ttft, e2e=e2e, output_tokens=tokens)


def test_tpot_and_goodput() -> None:
    fast = rec(0.1, 1.1, 11)  # tpot = 1.0 / 10 = 0.1
    slow_ttft = rec(0.9, 1.9, 11)  # tpot 0.1, ttft too slow
    slow_tpot = rec(0.1, 3.1, 11)  # tpot 0.3
    failed = rec(0.1, 1.1, 11, ok=False)
    assert fast.tpot == pytest.approx(0.1)
    records = [fast, slow_ttft, slow_tpot, failed]
    assert goodput(records, 2.0, slo_ttft=0.5, slo_tpot=0.2) == 0.5  # only `fast`, over 2 s
    assert goodput(records, 2.0, slo_ttft=None, slo_tpot=None) == 1.5  # all 3 that succeeded
    assert goodput(records, 2.0, slo_ttft=0.5, slo_tpot=None) == 1.0


def test_summary_throughput_and_distributions() -> None:
    records = [
        RequestRecord(
            0, True, prompt_tokens=100, output_tokens=10, ttft=0.2, e2e=1.1, itl=[0.1] * 9
        ),
        RequestRecord(
            0, True, prompt_tokens=50, output_tokens=20, ttft=0.4, e2e=2.3, itl=[0.1] * 19
        ),
        RequestRecord(0, False, error="boom"),
    ]
    s = summarize(records, duration=4.0)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["output_token_throughput"] == 30 / 4.0
    assert s["total_token_throughput"] == 180 / 4.0
    assert s["request_throughput"] == 0.5
    assert s["ttft_ms"]["p50"] == pytest.approx(300.0)
    assert s["itl_ms"]["p99"] == pytest.approx(100.0)
    assert s["tpot_ms"]["mean"] == pytest.approx((0.9 / 9 + 1.9 / 19) / 2 * 1e3)


def test_ttft_breakdown_disaggregated_and_colocated() -> None:
    t = {
        "arrived": 100.0,
        "remote_start": 100.01,
        "prefill_received": 100.02,
        "prefill_scheduled": 100.05,
        "prefill_computed": 100.55,
        "kv_complete": 100.58,
        "side_channel": 100.60,
    }
    b = ttft_breakdown(t, first_token_at=100.65)
    assert b["queueing"] == pytest.approx(0.01 + 0.03)
    assert b["prefill_compute"] == pytest.approx(0.5)
    assert b["exposed_transfer"] == pytest.approx(0.03)
    assert b["decode_admission"] == pytest.approx(0.05)
    assert b["ttft"] == pytest.approx(0.65)
    parts = ("queueing", "prefill_compute", "exposed_transfer", "decode_admission", "other")
    assert sum(b[k] for k in parts) == pytest.approx(b["ttft"])
    local = ttft_breakdown({"arrived": 5.0, "scheduled": 5.2}, first_token_at=5.5)
    assert local["queueing"] == pytest.approx(0.2) and local["prefill_compute"] == pytest.approx(
        0.3
    )
    assert local["exposed_transfer"] == 0.0
