"""The report of a benchmark run, computed only from per-request records (pure functions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the client saw of one request (seconds, on the client's monotonic clock)."""

    start: float
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks with text
    error: str | None = None
    timing: dict[str, float] | None = None  # the server's TTFT breakdown, if it sends one

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan if empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100
    lo = int(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def distribution(values: Sequence[float]) -> dict[str, float]:
    out = {f"p{p}": percentile(values, p) for p in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else float("nan")
    return out


def goodput(
    records: Sequence[RequestRecord],
    duration: float,
    slo_ttft: float | None,
    slo_tpot: float | None,
) -> float:
    """Requests per second that succeeded within every SLO given (seconds)."""
    good = 0
    for r in records:
        if not r.ok or r.ttft is None:
            continue
        if slo_ttft is not None and r.ttft > slo_ttft:
            continue
        tpot = r.tpot
        if slo_tpot is not None and tpot is not None and tpot > slo_tpot:
            continue
        good += 1
    return good / duration if duration > 0 else 0.0


def summarize(
    records: Sequence[RequestRecord],
    duration: float,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ms = lambda xs: {k: v * 1e3 for k, v in distribution(xs).items()}  # noqa: E731
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_token_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "ttft_ms": ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": ms([g for r in ok for g in r.itl]),
        "e2e_ms": ms([r.e2e for r in ok if r.e2e is not None]),
        "goodput": goodput(records, duration, slo_ttft, slo_tpot),
        "slo": {"ttft_ms": slo_ttft and slo_ttft * 1e3, "tpot_ms": slo_tpot and slo_tpot * 1e3},
    }
    timings = [r.timing for r in ok if r.timing]
    if timings:
        stages = sorted({k for t in timings for k in t})
        summary["ttft_breakdown_ms"] = {s: ms([t[s] for t in timings if s in t]) for s in stages}
    return summary


def record_dict(r: RequestRecord) -> dict[str, Any]:
    d = asdict(r)
    d["tpot"] = r.tpot
    return d
