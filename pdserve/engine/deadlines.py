"""Requests whose deadline passed, and where each one was when it did.

Every request carries an absolute deadline from the edge that took it (`RequestOptions
.deadline`: HTTP and gRPC alike, `--request-timeout` unless the request sets its own). The
engine thread fails the expired ones each turn, which frees their blocks; a request waiting
for remote KV is failed by its connector at the same deadline, naming the transfer's own stage,
and here only after a grace, should the connector not have.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.engine.failure import Failure, FailureReason
from pdserve.engine.sequence import Sequence, SequenceStatus

REMOTE_GRACE_S = 5.0  # the connector's own expiry comes first for requests waiting for KV


def stage_of(seq: Sequence) -> str:
    """Where a request stands: queued, prefill, remote prefill or decode."""
    if seq.status == SequenceStatus.WAITING_FOR_KV:
        return "remote prefill"
    if seq.status == SequenceStatus.WAITING:
        return "queued"
    if seq.num_computed_tokens < seq.num_prompt_tokens:
        return "prefill"
    return "decode"


def expired(requests: Iterable[Sequence], now: float) -> list[tuple[str, Failure]]:
    """(request id, its DEADLINE failure) of every request past its deadline at `now`
    (absolute time.time())."""
    late = []
    for seq in requests:
        deadline = seq.options.deadline
        if deadline is None or seq.status.finished:
            continue
        if seq.status == SequenceStatus.WAITING_FOR_KV:
            deadline += REMOTE_GRACE_S
        if deadline <= now:
            stage = stage_of(seq)
            message = f"deadline passed ({len(seq.output_token_ids)} tokens generated)"
            late.append((seq.request_id, Failure(FailureReason.DEADLINE, message, stage)))
    return late
