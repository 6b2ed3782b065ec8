"""Why a request failed, as data: a `FailureReason` (enum) with the stage, the peer and a
message. A failure is created where it happens and travels unchanged (through the resource
store, the remote-prefill result and `RequestOutput`) to the edges, where one table (`STATUS`,
below) maps its reason to a gRPC and an HTTP status. Nothing is ever classified by the text of
an error."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FailureReason(enum.Enum):
    DEADLINE = "deadline"  # the request's absolute deadline passed
    PEER_UNAVAILABLE = "peer_unavailable"  # a peer could not be reached, or went away
    TRANSFER_FAILED = "transfer_failed"  # the KV could not be delivered (refused, cut off)
    KV_CORRUPT = "kv_corrupt"  # KV arrived but does not match its checksum (--kv-checksum)
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


@dataclass(frozen=True)
class Status:
    grpc_code: str  # the name of a grpc.StatusCode (this layer does not import grpc)
    http_status: int
    error_type: str  # OpenAI error body "type"
    error_code: str  # OpenAI error body "code"


CLIENT_CLOSED = 499  # nginx's "client closed request": the response is never read

STATUS: dict[FailureReason, Status] = {
    FailureReason.DEADLINE: Status("DEADLINE_EXCEEDED", 504, "server_error", "timeout"),
    FailureReason.PEER_UNAVAILABLE: Status("UNAVAILABLE", 503, "server_error", "unavailable"),
    FailureReason.TRANSFER_FAILED: Status("ABORTED", 503, "server_error", "transfer_failed"),
    FailureReason.KV_CORRUPT: Status("DATA_LOSS", 502, "server_error", "kv_corrupt"),
    FailureReason.MODEL_MISMATCH: Status(
        "FAILED_PRECONDITION", 503, "server_error", "model_mismatch"
    ),
    FailureReason.INVALID_INPUT: Status(
        "INVALID_ARGUMENT", 400, "invalid_request_error", "invalid_request"
    ),
    FailureReason.DUPLICATE: Status(
        "ALREADY_EXISTS", 409, "invalid_request_error", "duplicate_request_id"
    ),
    FailureReason.CANCELLED: Status(
        "CANCELLED", CLIENT_CLOSED, "invalid_request_error", "cancelled"
    ),
    FailureReason.OVERLOADED: Status("RESOURCE_EXHAUSTED", 503, "server_error", "overloaded"),
    FailureReason.SHUTTING_DOWN: Status("UNAVAILABLE", 503, "server_error", "shutting_down"),
    FailureReason.INTERNAL: Status("INTERNAL", 500, "server_error", "internal"),
}
