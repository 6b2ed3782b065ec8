"""The breakdown of a request's time to first token into stages, from the nodes' own
wall-clock milestones (same clock on one machine; across machines it inherits their skew)."""

from __future__ import annotations

from pdserve.engine.sequence import Milestone as M
from pdserve.engine.sequence import Timings

STAGES = ("queueing", "prefill_compute", "exposed_transfer", "decode_admission", "other")


def ttft_breakdown(t: Timings, first_token_at: float) -> dict[str, float]:
    """Seconds per stage plus "ttft". Disaggregated requests carry prefill's milestones;
    colocated ones only arrived/scheduled. Stages sum to ttft ("other": RPC and scheduling
    gaps not attributed elsewhere)."""
    arrived = t[M.ARRIVED]
    ttft = first_token_at - arrived
    if M.KV_COMPLETE in t and M.PREFILL_COMPUTED in t:
        queue = (t[M.REMOTE_START] - arrived) + max(
            0.0, t[M.PREFILL_SCHEDULED] - t[M.PREFILL_RECEIVED]
        )
        compute = t[M.PREFILL_COMPUTED] - t[M.PREFILL_SCHEDULED]
        transfer = max(0.0, t[M.KV_COMPLETE] - t[M.PREFILL_COMPUTED])
        admission = first_token_at - max(t[M.KV_COMPLETE], t.get(M.SIDE_CHANNEL, 0.0))
    else:
        queue = t.get(M.SCHEDULED, arrived) - arrived
        compute = first_token_at - t.get(M.SCHEDULED, arrived)
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
