"""The control messages between nodes and to gRPC clients, built and read here only: sampling
parameters, a probe and its answer, a Prefill call and its response (read
back as the side channel decode claims), a Generate response, and node stats."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pdserve.config import DEFAULT_MAX_TOKENS
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import (
    Guide,
    GuideKind,
    Milestone,
    SamplingError,
    SamplingParams,
    Timings,
    TopLogprobs,
)
from pdserve.engine.snapshot import NodeSnapshot

if TYPE_CHECKING:
    from pdserve.engine.sequence import Sequence as EngineSequence

__all__ = [
    "HeadShard",
    "PrefillReport",
    "SideChannelData",
    "TransferStats",
    "generate_response",
    "peer_info",
    "peer_info_request",
    "prefill_request",
    "prefill_response",
    "sampling_from_proto",
    "sampling_to_proto",
    "side_channel_from_proto",
    "stats_to_proto",
    "top_logprobs_from_proto",
    "top_logprobs_to_proto",
]


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


# ---- probe ----------------------------------------------------------------------------------


class HeadShard(Protocol):
    """A tensor-parallel rank's share of the KV heads."""

    @property
    def head_start(self) -> int: ...

    @property
    def num_heads(self) -> int: ...


def peer_info_request(address: str, metadata: bytes, backend: str) -> pb.PeerInfoRequest:
    """A decode's probe, registering its KV receiver (address, transport metadata, backend)."""
    return pb.PeerInfoRequest(
        decode_transfer_address=address,
        decode_transfer_metadata=metadata,
        decode_transfer_backend=backend,
    )


def peer_info(
    node_fingerprint: pb.ModelFingerprint, transfer_metadata: bytes, shards: Sequence[HeadShard]
) -> pb.PeerInfo:
    """A prefill's answer to a probe: what its KV is and which ranks hold which heads."""
    return pb.PeerInfo(
        tp_size=len(shards),
        fingerprint=node_fingerprint,
        role="prefill",
        transfer_metadata=transfer_metadata,
        kv_ranks=[
            pb.KVRank(rank=r, head_start=s.head_start, head_count=s.num_heads)
            for r, s in enumerate(shards)
        ],
    )


# ---- a Prefill call -------------------------------------------------------------------------


def prefill_request(
    seq: EngineSequence,
    unique_key: str,
    transfer_address: str,
    blocks: list[int],
    cached_keys: list[bytes],
    deadline: float,
    head_bounds: list[int],
    migrate_handle: str = "",
    num_tokens: int | None = None,
) -> pb.PrefillRequest:
    """Decode's request to prefill `seq` into its `blocks` (the first `len(cached_keys)` of them
    already hold the prompt's prefix: prefill skips what it holds under the same keys). With a
    `migrate_handle`: to send the KV of `seq`'s first `num_tokens` tokens, held under that
    handle by the node that paused the stream."""
    token_ids = seq.prompt_token_ids if not migrate_handle else seq.all_token_ids[:num_tokens]
    return pb.PrefillRequest(
        request_id=seq.request_id,
        unique_key=unique_key,
        token_ids=token_ids,
        sampling=sampling_to_proto(seq.params),
        decode_transfer_address=transfer_address,
        target_block_ids=blocks,
        cached_block_keys=cached_keys,
        cache_salt=seq.options.cache_salt or "",
        deadline_unix=deadline,
        decode_kv_head_bounds=head_bounds if len(head_bounds) > 2 else (),
        migrate_handle=migrate_handle,
    )


class PrefillReport(Protocol):
    """What prefill reports back once the prompt's KV left (kv_sender.PrefillOutcome)."""

    has_first_token: bool
    first_token: int
    first_logprob: float
    first_top: TopLogprobs
    num_skipped_blocks: int
    num_prefill_cached_tokens: int
    bytes_sent: int
    started_at: float
    last_layer_sent_at: float
    scheduled_at: float
    computed_at: float


def prefill_response(outcome: PrefillReport) -> pb.PrefillResponse:
    return pb.PrefillResponse(
        has_first_token=outcome.has_first_token,
        first_token=outcome.first_token,
        first_logprob=outcome.first_logprob,
        first_top=top_logprobs_to_proto(outcome.first_top),
        num_skipped_blocks=outcome.num_skipped_blocks,
        num_prefill_cached_tokens=outcome.num_prefill_cached_tokens,
        bytes_sent=outcome.bytes_sent,
        prefill_started_unix=outcome.started_at,
        last_layer_sent_unix=outcome.last_layer_sent_at,
        prefill_scheduled_unix=outcome.scheduled_at,
        prefill_computed_unix=outcome.computed_at,
    )


@dataclass(frozen=True)
class SideChannelData:
    """A Prefill response as decode claims it: the first token and prefill's milestones."""

    has_first_token: bool
    first_token: int = 0
    first_logprob: float = 0.0
    first_top: TopLogprobs = ()
    num_skipped_blocks: int = 0
    num_prefill_cached_tokens: int = 0
    timings: Timings = field(default_factory=dict)  # prefill's milestones
    bytes_sent: int = 0  # the request's KV, as the prefill node sent it

    def transfer_stats(self) -> TransferStats | None:
        """The KV transfer as the prefill node saw it (its own clock), if it sent any."""
        t = self.timings
        start = t.get(Milestone.PREFILL_SCHEDULED, 0.0)
        end = t.get(Milestone.PREFILL_LAST_LAYER_SENT, 0.0)
        if not self.bytes_sent or not start or not end:
            return None
        computed = t.get(Milestone.PREFILL_COMPUTED, 0.0) or end
        wait = max(0.0, start - t.get(Milestone.PREFILL_RECEIVED, start))
        return TransferStats(self.bytes_sent, max(end - start, 0.0), max(end - computed, 0.0), wait)


@dataclass(frozen=True)
class TransferStats:
    """One request's KV transfer: bytes; seconds from its prompt's first step (layers go as
    they are computed) to its last layer sent; the seconds of that after the last layer was
    computed (exposed: not hidden behind compute); the prefill node's wait for a step."""

    bytes: int
    seconds: float
    exposed_s: float
    prefill_wait_s: float


def side_channel_from_proto(response: pb.PrefillResponse) -> SideChannelData:
    return SideChannelData(
        has_first_token=response.has_first_token,
        first_token=response.first_token,
        first_logprob=response.first_logprob,
        first_top=top_logprobs_from_proto(response.first_top),
        num_skipped_blocks=response.num_skipped_blocks,
        num_prefill_cached_tokens=response.num_prefill_cached_tokens,
        bytes_sent=response.bytes_sent,
        timings={
            Milestone.PREFILL_RECEIVED: response.prefill_started_unix,
            Milestone.PREFILL_SCHEDULED: response.prefill_scheduled_unix,
            Milestone.PREFILL_COMPUTED: response.prefill_computed_unix,
            Milestone.PREFILL_LAST_LAYER_SENT: response.last_layer_sent_unix,
            Milestone.SIDE_CHANNEL: time.time(),
        },
    )


# ---- a Generate stream ----------------------------------------------------------------------


def generate_response(out: RequestOutput, sent: int) -> pb.GenerateResponse:
    """What a Generate stream sends for `out` when `sent` of its tokens were sent before."""
    return pb.GenerateResponse(
        token_ids=out.token_ids[sent:],
        text=out.delta_text,
        finished=out.finished,
        finish_reason=out.finish_reason or "",
        logprobs=out.logprobs[sent:],
        remote_prefill=sent == 0 and out.remote_prefill,
        num_cached_tokens=out.num_cached_tokens,
    )


# ---- node stats -----------------------------------------------------------------------------


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
        kv_checksum_failures=total(snap.kv_checksum_failures),
    )
