"""gRPC between nodes: message size limits and channel options, the trailer that asks a decode
to register again, and a failure's reason mapped to a gRPC status and back (failure.STATUS is
the one table)."""

from __future__ import annotations

import grpc

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.engine.failure import STATUS, Failure, FailureReason

__all__ = [
    "CHANNEL_OPTIONS",
    "GRPC_OPTIONS",
    "REFUSAL_METADATA",
    "SERVER_OPTIONS",
    "UNREGISTERED",
    "failure_of_header",
    "grpc_code",
    "reason_of_grpc",
    "reason_of_name",
]

# The largest message is a Prefill request or a Generate prompt: token ids (5 bytes each at
# most) and block keys of one prompt, or its text. 4 MiB holds a 200,000-token prompt.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 4 << 20),
    ("grpc.max_receive_message_length", 4 << 20),
]
# A server's connections: at most this many calls at once on one (more wait on the client's
# side), and one without calls for 5 minutes is closed. Its port is its own: gRPC binds with
# SO_REUSEPORT unless told not to, and a second process given the same port would then start
# without error and take a share of the connections (seen in the suite: a soak's prefill
# sharing its port with another test's server, whose calls were reset once that one stopped).
SERVER_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.max_concurrent_streams", 256),
    ("grpc.max_connection_idle_ms", 300_000),
    ("grpc.so_reuseport", 0),
]
# A channel that failed to connect waits out a backoff (1 s by default, growing) before it
# tries again and fails calls at once meanwhile; a prefill node that comes up or back should
# be found within the probe cap.
CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


# A Prefill call refused because decode's transfer address is not registered carries this
# trailer; decode's client registers again (a probe) and retries once.
REFUSAL_METADATA = "x-pdserve-refusal"
UNREGISTERED = "unregistered-transfer-address"


def grpc_code(reason: FailureReason) -> grpc.StatusCode:
    """The gRPC status a failure with `reason` is answered with (failure.STATUS)."""
    return grpc.StatusCode[STATUS[reason].grpc_code]


# A peer's status code read back as a reason: the first reason the table maps to it. UNKNOWN
# is what a peer that died mid-call leaves.
_REASON_OF_CODE: dict[grpc.StatusCode, FailureReason] = {
    grpc.StatusCode.UNKNOWN: FailureReason.PEER_UNAVAILABLE
}
for _reason in STATUS:
    _REASON_OF_CODE.setdefault(grpc_code(_reason), _reason)


def reason_of_grpc(code: grpc.StatusCode) -> FailureReason:
    return _REASON_OF_CODE.get(code, FailureReason.TRANSFER_FAILED)


def reason_of_name(name: str) -> FailureReason:
    """A reason sent by a peer (a FAILURE frame); unknown names are transfer failures."""
    try:
        return FailureReason(name)
    except ValueError:
        return FailureReason.TRANSFER_FAILED


def failure_of_header(header: pb.TransferFrameHeader) -> Failure:
    """The failure a prefill node reported in a FAILURE frame."""
    message = f"prefill reported: {header.error}"
    return Failure(reason_of_name(header.reason), message, header.stage)
