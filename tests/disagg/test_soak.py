"""A short soak (`benchmarks/soak.py`): a real prefill + decode pair, concurrent requests with
random lengths, a fifth of the clients cancelling at random points, prefill stalled for 3 s and
later killed and restarted. Completed outputs equal the colocated engine's, no request fails
(decode computes what the dead prefill left undone), and both nodes end with nothing held."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_short_soak_leaks_nothing_and_matches_colocated(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    assert spec is not None and spec.loader is not None
    soak = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = soak  # its dataclasses look their module up while being defined
    spec.loader.exec_module(soak)
    report = soak.run_soak(num_requests=40, rate=2.0, seed=1)
    (tmp_path / "soak.json").write_text(json.dumps(report, indent=2))
    summary = {k: v for k, v in report.items() if k != "outcomes"}
    assert report["completed"] >= 20, summary
    assert report["cancelled_by_client"] >= 1, summary
    assert report["mismatched_outputs"] == [], summary
    # The prefill's stall, its death and its restart cost no request: decode computes what a
    # dead prefill node left undone (--prefill-failure local, the default).
    assert report["failed"] == 0, summary
    assert report["failed_late"] == [] and report["failed_without_reason"] == [], summary
    assert report["kv_checksum_failures"] == 0, summary  # every frame verified: no false alarm
    for node in ("decode_after", "prefill_after"):
        state = report[node]
        assert state["free"] and state["store_empty"] and state["no_pending"], summary
        assert state["threads_at_baseline"], summary
    assert report["passed"], summary
