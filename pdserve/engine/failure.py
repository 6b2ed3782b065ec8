"""Why a request failed, as data: a `FailureReason` (enum) with the stage, the peer and a
message. A failure is created where it happens and travels unchanged (through the resource
store, the remote-prefill result and `RequestOutput`) to the edges, where one table
(`pdserve.disagg.wire.STATUS`) maps its reason to a gRPC and an HTTP status. Nothing is ever
classified by the text of an error."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FailureReason(enum.Enum):
    DEADLINE = "deadline"  # the request's absolute deadline passed
    PEER_UNAVAILABLE = "peer_unavailable"  # a peer could not be reached, or went away
    TRANSFER_FAILED = "transfer_failed"  # the KV could not be delivered (refused, cut off)
    MODEL_MISMATCH = "model_mismatch"  # the peers serve different models or cache layouts
    INVALID_INPUT = "invalid_input"  # the request cannot be served as given
    DUPLICATE = "duplicate"  # a request with this id is in the engine (or its blocks still held)
    CANCELLED = "cancelled"  # the client (or decode, for prefill) went away
    OVERLOADED = "overloaded"  # admission refused: too many requests in flight
    SHUTTING_DOWN = "shutting_down"  # the node is stopping
    INTERNAL = "internal"  # a bug or an unexpected error (see the node's log)


@dataclass(frozen=True)
class Failure:
    reason: FailureReason
    message: str
    stage: str = ""  # where the request was (e.g. "transferring", "peer info probe")
    peer: str = ""  # the other node involved, if any

    def __str__(self) -> str:
        # A peer's message read back from the wire may already name the stage.
        stage = f"stage: {self.stage}"
        where = [stage] if self.stage and stage not in self.message else []
        if self.peer and self.peer not in self.message:
            where.append(f"peer: {self.peer}")
        return f"{self.message} ({', '.join(where)})" if where else self.message


class RequestFailed(Exception):
    """An operation on a request failed; `failure` says why."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(str(failure))
        self.failure = failure
