"""What crosses the wire between nodes and to clients: proto converters (sampling parameters,
node stats, failures), the model fingerprint peers compare, gRPC channel options, and the one
table that maps each failure reason to a gRPC status and an HTTP status with an OpenAI error
type and code."""

from __future__ import annotations

import math
from collections.abc import Iterable

import grpc

from pdserve.config import DEFAULT_MAX_TOKENS, MAX_REQUEST_TIMEOUT_S, ModelConfig
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.engine.failure import STATUS, Failure, FailureReason
from pdserve.engine.sequence import Guide, GuideKind, SamplingError, SamplingParams, TopLogprobs
from pdserve.engine.snapshot import NodeSnapshot

# The largest message is a Prefill request or a Generate prompt: token ids (5 bytes each at
# most) and block keys of one prompt, or its text. 4 MiB holds a 200,000-token prompt.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 4 << 20),
    ("grpc.max_receive_message_length", 4 << 20),
]
# A server's connections: at most this many calls at once on one (more wait on the client's
# side), and one without calls for 5 minutes is closed.
SERVER_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.max_concurrent_streams", 256),
    ("grpc.max_connection_idle_ms", 300_000),
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


# ---- failures -----------------------------------------------------------------------------


MAX_ID_CHARS = 256  # request ids and unique keys


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


# ---- sampling -----------------------------------------------------------------------------


def sampling_to_proto(p: SamplingParams) -> pb.SamplingConfig:
    return pb.SamplingConfig(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        has_seed=p.seed is not None,
        seed=p.seed or 0,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        min_tokens=p.min_tokens,
        logit_bias=[pb.LogitBias(token=t, bias=b) for t, b in p.logit_bias],
        guide_kind=p.guide.kind.value if p.guide else "",
        guide_spec=p.guide.spec if p.guide else "",
    )


def sampling_from_proto(c: pb.SamplingConfig) -> SamplingParams:
    # proto3 has no presence for scalars: 0 means "not set" where 0 is not a valid value.
    return SamplingParams(
        max_tokens=c.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=c.temperature,
        top_p=c.top_p or 1.0,
        top_k=c.top_k,
        seed=c.seed if c.has_seed else None,
        stop=tuple(c.stop),
        stop_token_ids=tuple(c.stop_token_ids),
        ignore_eos=c.ignore_eos,
        logprobs=c.logprobs,
        top_logprobs=c.top_logprobs,
        presence_penalty=c.presence_penalty,
        frequency_penalty=c.frequency_penalty,
        repetition_penalty=c.repetition_penalty or 1.0,
        min_tokens=c.min_tokens,
        logit_bias=tuple((b.token, b.bias) for b in c.logit_bias),
        guide=_guide_from_proto(c.guide_kind, c.guide_spec),
    )


def _guide_from_proto(kind: str, spec: str) -> Guide | None:
    if not kind:
        return None
    try:
        return Guide(GuideKind(kind), spec)
    except ValueError:
        raise SamplingError(f"unknown structured-output kind {kind!r}") from None


def top_logprobs_to_proto(top: TopLogprobs) -> list[pb.TopLogprob]:
    return [pb.TopLogprob(token=t, logprob=lp) for t, lp in top]


def top_logprobs_from_proto(top: Iterable[pb.TopLogprob]) -> TopLogprobs:
    return tuple((t.token, t.logprob) for t in top)


# ---- model fingerprint --------------------------------------------------------------------

FINGERPRINT_FIELDS = (
    "architecture",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "block_size",
    "quantization",
    "transfer_backend",
)


def fingerprint(
    model: ModelConfig, dtype: str, block_size: int, quantization: str, transfer_backend: str
) -> pb.ModelFingerprint:
    """What two peers must share for one's KV to continue the other's computation: the weights'
    quantization included (KV computed from int4 weights is not bf16's), and the transfer
    backend that moves it."""
    return pb.ModelFingerprint(
        architecture=model.architecture,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=dtype,
        block_size=block_size,
        quantization=quantization,
        transfer_backend=transfer_backend,
    )


def fingerprint_mismatch(local: pb.ModelFingerprint, remote: pb.ModelFingerprint) -> str | None:
    diffs = [
        f"{name}: decode={getattr(local, name)!r} prefill={getattr(remote, name)!r}"
        for name in FINGERPRINT_FIELDS
        if getattr(local, name) != getattr(remote, name)
    ]
    return "; ".join(diffs) if diffs else None


# ---- deadlines and ids as they arrive -----------------------------------------------------


def timeout_problem(timeout_s: float) -> str | None:
    """Why a Generate's `timeout_s` is refused (0: the node's default), or None."""
    if timeout_s == 0:
        return None
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= MAX_REQUEST_TIMEOUT_S):
        return f"timeout_s must be in (0, {MAX_REQUEST_TIMEOUT_S:.0f}] seconds, got {timeout_s}"
    return None


def deadline_problem(deadline_unix: float, now: float) -> str | None:
    """Why a Prefill's absolute deadline is refused (not a time, or beyond the longest
    timeout), or None; a deadline already past is the caller's DEADLINE, not a bad value."""
    if not (math.isfinite(deadline_unix) and deadline_unix <= now + MAX_REQUEST_TIMEOUT_S):
        return (
            f"deadline_unix must be a time within {MAX_REQUEST_TIMEOUT_S:.0f} s, "
            f"got {deadline_unix}"
        )
    return None


def id_problem(name: str, value: str) -> str | None:
    if len(value) > MAX_ID_CHARS:
        return f"{name} of at most {MAX_ID_CHARS} characters, got {len(value)}"
    return None


def head_bounds_problem(bounds: list[int], num_kv_heads: int) -> str | None:
    """Why decode's KV head bounds (where its ranks split the heads, e.g. [0, 2, 4]) do not
    split this model's heads, or None."""
    if bounds[:1] != [0] or bounds[-1] != num_kv_heads or bounds != sorted(set(bounds)):
        return f"decode's KV head bounds {bounds[:16]} do not split {num_kv_heads} KV heads"
    return None


def kv_ranks_problem(info: pb.PeerInfo, num_kv_heads: int) -> str | None:
    """Why a prefill's tensor-parallel ranks, as its probe answer reports them, cannot supply
    every KV head of the model, or None (no ranks reported: one rank holds them all)."""
    if not info.kv_ranks:
        return None
    if len(info.kv_ranks) != info.tp_size:
        return f"tensor-parallel size {info.tp_size} with {len(info.kv_ranks)} ranks reported"
    held: set[int] = set()
    for r in info.kv_ranks:
        end = r.head_start + r.head_count
        if r.head_count < 1 or r.head_start < 0 or end > num_kv_heads:
            return f"rank {r.rank} holds KV heads [{r.head_start}, {end}) of {num_kv_heads}"
        held.update(range(r.head_start, end))
    if len(held) != num_kv_heads:
        return f"its ranks hold KV heads {sorted(held)}, not all {num_kv_heads}"
    return None


# ---- node stats ---------------------------------------------------------------------------


def stats_to_proto(snap: NodeSnapshot) -> pb.NodeStats:
    """The gRPC view of the same snapshot Prometheus renders."""
    total, count = NodeSnapshot.total, NodeSnapshot.count
    return pb.NodeStats(
        num_blocks=int(snap.kv_blocks_total),
        num_free_blocks=int(snap.kv_blocks_free),
        num_requests=int(
            snap.num_requests_running + snap.num_requests_waiting + snap.num_requests_waiting_for_kv
        ),
        resource_store_entries=int(snap.resource_store_entries or 0),
        side_channel_entries=int(snap.side_channel_entries or 0),
        tombstones=int(snap.tombstones or 0),
        pending_tasks=int(snap.pending_transfers or 0),
        frames_rejected=total(snap.frames_rejected),
        bytes_received=count(snap.transfer_bytes, "received"),
        bytes_sent=count(snap.transfer_bytes, "sent"),
        not_split=total(snap.not_split),
        held_for_send=int(snap.held_for_send),
        transfer_links_opened=count(snap.transfer_links, "opened"),
        threads=int(snap.threads or 0),
        transfer_connections={k: int(v) for k, v in (snap.transfer_connections or {}).items()},
        grpc_unauthenticated=total(snap.grpc_unauthenticated),
    )


def failure_of_header(header: pb.TransferFrameHeader) -> Failure:
    """The failure a prefill node reported in a FAILURE frame."""
    message = f"prefill reported: {header.error}"
    return Failure(reason_of_name(header.reason), message, header.stage)
