"""Decode side of the connector: decides which requests to split, registers each handoff in
the resource store, calls prefill, and hands completed (or failed) handoffs to the engine.

Lifecycle of a handoff (decode request -> unique key): `plan_remote_prefill` (counted) ->
blocks allocated -> `start_remote_prefill` registers the receive entry and starts the Prefill
call on the event loop -> frames fill the blocks (receiver threads) and the call's response
fills the side channel -> the store reports the key ready -> `poll_remote_prefills` claims it
on the engine thread. `abort_remote_prefill` cancels the call and the entry without waiting;
if a frame is still being written into the blocks (or a failed entry is claimed mid-write),
`request_finished` holds the request's blocks until the store releases the key, and
`poll_finished_sends` hands them back. Every path removes the key from `_calls`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from pdserve import tracing
from pdserve.config import (
    DEFAULT_MIN_PREFILL_TOKENS,
    DEFAULT_PREFILL_PLACEMENT,
    DEFAULT_REQUEST_TIMEOUT_S,
)
from pdserve.disagg.placement import Placement
from pdserve.disagg.prefill_client import PrefillCallError, PrefillClient
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.receive_entry import ClaimResult
from pdserve.disagg.resource_store import ResourceStore
from pdserve.disagg.wire import (
    TransferStats,
    prefill_request,
    side_channel_from_proto,
)
from pdserve.engine.block_pool import key_bytes
from pdserve.engine.connector import KVConnector, RemotePrefillResult
from pdserve.engine.failure import Failure, FailureReason
from pdserve.engine.kv_manager import first_block_sent
from pdserve.engine.sequence import LOCAL_PREFILL, Migration, Milestone, Sequence
from pdserve.engine.snapshot import NodeSnapshot

logger = logging.getLogger(__name__)


def _migration(seq: Sequence) -> Migration | None:
    """Where a stream migrated here has its KV (None: any other request)."""
    resume = seq.options.resume
    return resume.source if resume is not None and resume.token_ids else None


SWEEP_INTERVAL_S = 0.25


# A prefill node's failures that say nothing against the request itself: its prompt is then
# computed on decode (`SplitPolicy.local_on_failure`), in the blocks it already holds.
PEER_FAILURES = frozenset(
    {
        FailureReason.PEER_UNAVAILABLE,  # it died, or cannot be reached
        FailureReason.SHUTTING_DOWN,  # it is stopping
        FailureReason.TRANSFER_FAILED,  # the transfer was cut off or refused
        FailureReason.KV_CORRUPT,  # what arrived does not match its checksum
        FailureReason.INTERNAL,  # its own error
    }
)


@dataclass(frozen=True)
class SplitPolicy:
    # Shorter prompts, or prompts whose part decode has not cached is shorter, stay on decode.
    min_prompt_tokens: int = DEFAULT_MIN_PREFILL_TOKENS
    default_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    local_on_failure: bool = True  # a prefill node's failure: compute the prompt here
    placement: str = DEFAULT_PREFILL_PLACEMENT  # PREFILL_PLACEMENTS (placement.py)


@dataclass(frozen=True)
class KVLayout:
    """Decode's KV cache as handoffs see it: layers, tokens per block, bytes of a block's K
    and V in one layer, and where this node's ranks split the KV heads (empty: one rank)."""

    num_layers: int
    block_size: int
    block_bytes: int
    head_bounds: tuple[int, ...] = ()
    windows: tuple[int | None, ...] = ()  # each layer's sliding window (empty: none)


@dataclass
class _Call:
    unique_key: str
    future: Future[None]
    tokens: int = 0  # prompt tokens the prefill node computes for it


class KVLoader(KVConnector):
    def __init__(
        self,
        store: ResourceStore,
        client: PrefillClient,
        loop: asyncio.AbstractEventLoop,
        layout: KVLayout,
        policy: SplitPolicy,
        on_handoff: Callable[[float], None] = lambda seconds: None,  # transfer latency
        on_transfer: Callable[[TransferStats], None] = lambda stats: None,  # per request
    ) -> None:
        self.store = store
        self.client = client
        self.loop = loop
        self.transfer_address = client.registration.address  # where prefill sends the KV
        self.num_layers = layout.num_layers
        self.block_size = layout.block_size
        self.block_bytes = layout.block_bytes
        self.policy = policy
        self.head_bounds = list(layout.head_bounds)
        self.windows = layout.windows or (None,) * layout.num_layers
        self._calls: dict[str, _Call] = {}  # request id -> in-flight handoff
        self._keys: dict[str, str] = {}  # unique key -> request id
        self._draining: dict[str, str] = {}  # unique key -> request id whose blocks are held
        # unique key -> request id whose prefill failed while a frame was still being written
        # into its blocks: computed here once the writer is out
        self._local_once_out: dict[str, str] = {}
        self._released: list[str] = []  # keys whose last writer is out, for poll_finished_sends
        self._last_sweep = 0.0
        self.not_split: dict[str, int] = {}
        self.placement = Placement(policy.placement)
        self.placed: dict[str, int] = {}  # --prefill-placement measured's choices, by why
        self.failures: dict[str, int] = {}
        self.bytes_skipped = 0
        self._started: dict[str, float] = {}  # request id -> when its handoff started
        # request id -> tokens whose KV a migrated stream fetches from the node that paused it
        self._migrating: dict[str, int] = {}
        self.migrations: dict[str, int] = {}  # streams migrated here: "in", "failed"
        self.on_handoff = on_handoff
        self.on_transfer = on_transfer

    # ---- engine thread ------------------------------------------------------------------

    def plan_remote_prefill(self, seq: Sequence) -> bool:
        if _migration(seq) is not None:
            return True  # its KV is fetched from the node that paused it
        reason = None
        if seq.options.after is not None:
            reason = "shares_prompt"  # another choice's prefill fills the blocks it shares
        elif not seq.options.allow_split:
            reason = "split_not_allowed"
        elif seq.options.prefill_peer == LOCAL_PREFILL:
            reason = "router_local"
        elif seq.params.max_tokens <= 1:
            reason = "max_tokens_1"
        elif seq.num_prompt_tokens < self.policy.min_prompt_tokens:
            reason = "short_prompt"
        elif not self.client.has_healthy():
            reason = "no_healthy_prefill"
        if reason is not None:
            self._count_not_split(seq.request_id, reason)
            return False
        return True

    def keep_remote_prefill(self, seq: Sequence, local_backlog: int) -> bool:
        """Decided on what is left to compute once decode's own prefix cache is counted: a
        prompt whose uncached rest is shorter than --min-prefill-tokens is finished here
        (`short_suffix`), not sent across for a few tokens."""
        if _migration(seq) is not None:
            if seq.num_cached_tokens < seq.num_tokens - 1:
                return True
            self._count_not_split(seq.request_id, "migration_cached")  # nothing to fetch
            return False
        uncached = seq.num_prompt_tokens - seq.num_cached_tokens
        if uncached < self.policy.min_prompt_tokens:
            self._count_not_split(seq.request_id, "short_suffix")
            return False
        here, there = local_backlog + uncached, self._remote_backlog() + uncached
        remote, why = self.placement.choose(here, there)
        if why != "static":
            self.placed[why] = self.placed.get(why, 0) + 1
            seq.placement_tokens = there if remote else here
        if not remote:
            self._count_not_split(seq.request_id, f"placed_local_{why}")
        return remote

    def _remote_backlog(self) -> int:
        """Prompt tokens out on prefill nodes whose KV has not all arrived."""
        return sum(call.tokens for call in self._calls.values())

    def _count_not_split(self, request_id: str, reason: str) -> None:
        self.not_split[reason] = self.not_split.get(reason, 0) + 1
        logger.info("request %s runs locally (%s)", request_id, reason)

    @staticmethod
    def _overloaded(failure: Failure | None) -> bool:
        return failure is not None and failure.reason == FailureReason.OVERLOADED

    def _local_after(self, failure: Failure | None) -> bool:
        """Whether a handoff that failed so is computed here instead of failing."""
        return (
            self.policy.local_on_failure and failure is not None and failure.reason in PEER_FAILURES
        )

    def start_remote_prefill(self, seq: Sequence) -> None:
        unique_key = f"{seq.request_id}-{uuid.uuid4().hex[:12]}"
        deadline = seq.options.deadline or time.time() + self.policy.default_timeout_s
        migration = _migration(seq)
        # A prompt's KV, computed by a prefill node; a migrated stream's, of every token but
        # the last one, from the node that paused it.
        num_tokens = seq.num_prompt_tokens if migration is None else seq.num_tokens - 1
        num_prompt_blocks = -(-num_tokens // self.block_size)
        blocks = seq.block_table[:num_prompt_blocks]
        skip = seq.num_cached_tokens // self.block_size
        # a windowed layer gets only the blocks its window still reads
        firsts = [max(skip, first_block_sent(w, num_tokens, self.block_size)) for w in self.windows]
        seq.window_blocks_from = max(firsts)  # blocks before: not every layer's KV is here
        self.store.register(
            unique_key,
            seq.request_id,
            blocks[skip:],
            [num_prompt_blocks - first for first in firsts],
            self.num_layers,
            self.block_bytes,
            deadline,
            num_kv_heads=self.head_bounds[-1] if self.head_bounds else 1,
        )
        self.bytes_skipped += skip * self.block_bytes * self.num_layers
        cached = [key_bytes(k) for k in seq.block_keys[:skip]]
        request = prefill_request(
            seq,
            unique_key,
            self.transfer_address,
            blocks,
            cached,
            deadline,
            self.head_bounds,
            "" if migration is None else migration.handle,
            num_tokens,
        )
        seq.timings[Milestone.REMOTE_START] = time.time()
        self._started[seq.request_id] = time.monotonic()
        logger.info(
            "request %s: %s as %s (%d tokens, %d blocks cached here)",
            seq.request_id,
            "remote prefill" if migration is None else f"KV fetch from {migration.address}",
            unique_key,
            num_tokens,
            skip,
        )
        trace = seq.options.trace
        if migration is None:
            call = self._call_prefill(request, seq.options.prefill_peer, trace=trace)
        else:
            self._migrating[seq.request_id] = num_tokens
            call = self._call_prefill(request, migration.address, True, trace)
        future = asyncio.run_coroutine_threadsafe(call, self.loop)
        computed = num_tokens - seq.num_cached_tokens if migration is None else 0
        self._calls[seq.request_id] = _Call(unique_key, future, computed)
        self._keys[unique_key] = seq.request_id

    async def _call_prefill(
        self,
        request: pb.PrefillRequest,
        prefer: str | None,
        migrate: bool = False,
        trace: str | None = None,
    ) -> None:
        key = request.unique_key
        span = tracing.start(
            "pdserve.decode.prefill_call" if not migrate else "pdserve.decode.kv_fetch",
            trace,
            tracing.Kind.CLIENT,
            {"pdserve.unique_key": key, "pdserve.prompt_tokens": len(request.token_ids)},
        )
        metadata = () if span.traceparent is None else ((tracing.TRACEPARENT, span.traceparent),)

        def on_chosen(peer: str) -> None:
            self.store.set_peer(key, peer)
            span.set({"server.address": peer})

        try:
            if migrate:
                assert prefer is not None
                _, response = await self.client.migrate(request, prefer, on_chosen, metadata)
            else:
                _, response = await self.client.prefill(
                    request, on_chosen, prefer, lambda: self.store.untouched(key), metadata
                )
        except PrefillCallError as e:
            logger.warning("request %s: %s", request.request_id, e)
            span.fail(e.failure.reason.value, str(e.failure))
            span.end()
            self.store.fail(key, e.failure)
            return
        except Exception as e:  # a bug must still end the request, not vanish in a future
            logger.exception("request %s: prefill call failed", request.request_id)
            message = f"prefill call failed: {type(e).__name__}: {e}"
            span.fail(FailureReason.INTERNAL.value, message)
            span.end()
            self.store.fail(key, Failure(FailureReason.INTERNAL, message, "prefill"))
            return
        span.end()
        side = side_channel_from_proto(response)
        stats = side.transfer_stats()
        if stats is not None:
            self.on_transfer(stats)
        if not self.store.put_side_channel(key, side, request.deadline_unix):
            logger.warning("request %s: first token arrived after its deadline", request.request_id)

    def poll_remote_prefills(self) -> list[RemotePrefillResult]:
        now = time.monotonic()
        if now - self._last_sweep >= SWEEP_INTERVAL_S:
            self._last_sweep = now
            self.store.sweep()
        results = []
        for key in self.store.pop_released():
            request_id = self._local_once_out.pop(key, None)
            if request_id is None:
                self._released.append(key)
            else:
                self._count_not_split(request_id, "prefill_failed")
                results.append(RemotePrefillResult(request_id, prefill_locally=True))
        for key in self.store.pop_ready():
            claimed = self.store.claim(key)
            if claimed is None:
                continue  # taken already, or a frame is still being written (re-reported)
            request_id = self._keys.pop(key, None)
            if request_id is None:
                continue
            call = self._calls.pop(request_id, None)
            if call is not None:
                call.future.cancel()  # a failed entry may still have its call running
            if claimed.draining:
                self._draining[key] = request_id
            started = self._started.pop(request_id, None)
            side = claimed.side_channel
            fetched = self._migrating.pop(request_id, None)
            if fetched is not None:
                results += self._migrated(key, request_id, fetched, claimed)
            elif claimed.failure is None and side is not None and side.has_first_token:
                if started is not None:
                    self.on_handoff(time.monotonic() - started)
                timings = dict(side.timings)
                if claimed.done_at is not None:
                    timings[Milestone.KV_COMPLETE] = claimed.done_at
                results.append(
                    RemotePrefillResult(
                        request_id,
                        side.first_token,
                        side.first_logprob,
                        side.first_top,
                        timings=timings,
                    )
                )
            elif self._overloaded(claimed.failure) and not claimed.draining:
                self._count_not_split(request_id, "prefill_overloaded")
                results.append(RemotePrefillResult(request_id, prefill_locally=True))
            elif self._local_after(claimed.failure):
                assert claimed.failure is not None
                logger.warning(
                    "request %s: prefill failed (%s); computing the prompt here",
                    request_id,
                    claimed.failure,
                )
                self._count_failure(claimed.failure.reason)
                # Computing the prompt here overwrites whatever part of it had arrived, once no
                # frame writes into its blocks any more.
                if claimed.draining:
                    del self._draining[key]
                    self._local_once_out[key] = request_id
                else:
                    self._count_not_split(request_id, "prefill_failed")
                    results.append(RemotePrefillResult(request_id, prefill_locally=True))
            else:
                failure = claimed.failure or Failure(
                    FailureReason.INTERNAL, "prefill returned no first token", "claim"
                )
                self._count_failure(failure.reason)
                results.append(RemotePrefillResult(request_id, failure=failure))
        return results

    def _migrated(
        self, key: str, request_id: str, fetched: int, claimed: ClaimResult
    ) -> list[RemotePrefillResult]:
        """A migrated stream's fetch, claimed: it goes on from its fetched KV, or, where the
        fetch failed (the node that paused it died or stopped, say), computes its tokens here."""
        failure = claimed.failure
        if failure is None and claimed.side_channel is not None:
            self.migrations["in"] = self.migrations.get("in", 0) + 1
            timings = dict(claimed.side_channel.timings)
            if claimed.done_at is not None:
                timings[Milestone.KV_COMPLETE] = claimed.done_at
            return [RemotePrefillResult(request_id, computed_tokens=fetched, timings=timings)]
        failure = failure or Failure(FailureReason.INTERNAL, "no KV fetch outcome", "claim")
        # Past its deadline it ends; any other failure is the source's (its gRPC server stopping
        # mid-call answers CANCELLED: this stream's own cancel never reaches here, `abort_remote_
        # prefill` forgets its call), and the stream goes on from its tokens, computed here.
        if failure.reason == FailureReason.DEADLINE:
            self._count_failure(failure.reason)
            return [RemotePrefillResult(request_id, failure=failure)]
        logger.warning(
            "request %s: KV fetch failed (%s); computing the stream here", request_id, failure
        )
        self.migrations["failed"] = self.migrations.get("failed", 0) + 1
        if claimed.draining:  # computed once no frame writes into its blocks any more
            del self._draining[key]
            self._local_once_out[key] = request_id
            return []
        self._count_not_split(request_id, "migration_failed")
        return [RemotePrefillResult(request_id, prefill_locally=True)]

    def abort_remote_prefill(self, seq: Sequence) -> None:
        for key, request_id in list(self._local_once_out.items()):
            if request_id == seq.request_id:  # ended while a failed frame is still writing:
                del self._local_once_out[key]  # its blocks are held until the writer is out
                self._draining[key] = request_id
        call = self._calls.pop(seq.request_id, None)
        self._started.pop(seq.request_id, None)
        self._migrating.pop(seq.request_id, None)
        if call is None:
            return
        self._count_failure(FailureReason.CANCELLED)
        self._keys.pop(call.unique_key, None)
        call.future.cancel()  # cancels the Prefill RPC: prefill sees it and stops
        if self.store.cancel(call.unique_key):
            self._draining[call.unique_key] = seq.request_id

    def request_finished(self, seq: Sequence) -> bool:
        """Hold the blocks of a request whose handoff is still being written into them. (And
        learn how long its first token took, where it was computed.)"""
        self._observe(seq)
        return seq.request_id in self._draining.values()

    def _observe(self, seq: Sequence) -> None:
        """A finished request's time from scheduled to first token, for `Placement`, over the
        prompt tokens it was placed at: prompts placed by `measured` and prefilled there (not
        computed here after a failed handoff, not resumed streams)."""
        t = seq.timings
        first, scheduled = t.get(Milestone.FIRST_TOKEN), t.get(Milestone.SCHEDULED)
        if first is None or scheduled is None or seq.options.resume is not None:
            return
        if seq.placement_tokens <= 0:
            return  # not placed by measured (a short prompt, a static rule)
        remote = Milestone.REMOTE_START in t
        if remote != seq.remote_prefill:
            return  # computed here after a failed handoff
        self.placement.observe(remote, seq.placement_tokens, first - scheduled)

    def poll_finished_sends(self) -> list[str]:
        released, self._released = self._released + self.store.pop_released(), []
        return [rid for key in released if (rid := self._draining.pop(key, None))]

    def _count_failure(self, reason: FailureReason) -> None:
        self.failures[reason.value] = self.failures.get(reason.value, 0) + 1

    def add_stats(self, snapshot: NodeSnapshot) -> None:
        store = self.store.stats()
        snapshot.resource_store_entries = store.entries
        snapshot.side_channel_entries = store.side_channel
        snapshot.tombstones = store.tombstones
        snapshot.prefill_placement = dict(self.placed)
        snapshot.pending_transfers = len(self._calls)
        snapshot.transfer_bytes = {
            "received": store.bytes_received,
            "skipped": self.bytes_skipped,  # decode held those blocks already
        }
        snapshot.frames_rejected = dict(store.frames_rejected)
        snapshot.transfer_failures = dict(self.failures)
        snapshot.not_split = dict(self.not_split)
        snapshot.migrations = {**(snapshot.migrations or {}), **self.migrations}
