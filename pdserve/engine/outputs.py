"""What the engine hands back per request: `RequestOutput` (tokens, text and the text delta so
far, finish reason or failure, milestones), and `RequestError` for a request that cannot be
served as given."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.failure import Failure, FailureReason, RequestFailed
from pdserve.engine.sequence import Sequence, SequenceStatus, Timings, TopLogprobs


class RequestError(RequestFailed, ValueError):
    """A request cannot be served as given (too long, duplicate id, ...)."""

    def __init__(self, message: str, reason: FailureReason = FailureReason.INVALID_INPUT) -> None:
        super().__init__(Failure(reason, message))


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far
    delta_text: str  # text not returned before
    logprobs: list[float]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    failure: Failure | None = None
    remote_prefill: bool = False
    timings: Timings | None = None  # wall-clock milestones (first token and when finished)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # per token, if asked

    @property
    def error(self) -> str | None:
        return None if self.failure is None else str(self.failure)


def output_of(seq: Sequence) -> RequestOutput:
    """The request's output now (its text delta taken: the next one continues from here)."""
    detok = seq.detokenizer
    assert detok is not None
    finished = seq.status.finished
    # A stream handed to another node keeps text held back for a possible stop string: that
    # node sends it, or not, as the stream goes on.
    final = finished and seq.status != SequenceStatus.FINISHED_MIGRATED
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=list(seq.output_token_ids),
        text=detok.text,
        delta_text=detok.delta(final=final),
        logprobs=list(seq.output_logprobs),
        top_logprobs=list(seq.output_top_logprobs),
        finished=finished,
        finish_reason=seq.status.value if finished else None,
        num_cached_tokens=seq.num_cached_tokens,
        failure=seq.failure,
        remote_prefill=seq.remote_prefill,
        timings=dict(seq.timings) if finished or len(seq.output_token_ids) == 1 else None,
    )
