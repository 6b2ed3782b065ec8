"""The breakdown of a request's time to first token into stages, from the nodes' own
wall-clock milestones (same clock on one machine; across machines it inherits their skew)."""

from __future__ import annotations

STAGES = ("queueing", "prefill_compute", "exposed_transfer", "decode_admission", "other")


def ttft_breakdown(t: dict[str, float], first_token_at: float) -> dict[str, float]:
    """Seconds per stage plus "ttft". Disaggregated requests carry prefill's milestones;
    colocated ones only arrived/scheduled. Stages sum to ttft ("other": RPC and scheduling
    gaps not attributed elsewhere)."""
    arrived = t["arrived"]
    ttft = first_token_at - arrived
    if "kv_complete" in t and "prefill_computed" in t:
        queue = (t["remote_start"] - arrived) + max(
            0.0, t["prefill_scheduled"] - t["prefill_received"]
        )
        compute = t["prefill_computed"] - t["prefill_scheduled"]
        transfer = max(0.0, t["kv_complete"] - t["prefill_computed"])
        admission = first_token_at - max(t["kv_complete"], t.get("side_channel", 0.0))
    else:
        queue = t.get("scheduled", arrived) - arrived
        compute = first_token_at - t.get("scheduled", arrived)
        transfer = admission = 0.0
    parts = {
        "queueing": queue,
        "prefill_compute": compute,
        "exposed_transfer": transfer,
        "decode_admission": admission,
    }
    parts["other"] = ttft - sum(parts.values())
    parts["ttft"] = ttft
    return parts
