"""Decode's client for prefill nodes: one pooled grpc.aio channel per address, the peer's info
(tp size, model fingerprint) probed with a clamped deadline and cached with a TTL, and the
choice of the least-loaded healthy node. A node that fails is not chosen again until a retry
interval has passed (then one request probes it). Lives on the node's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from pdserve.config import DEFAULT_PROBE_CAP_S, Secret, TlsFiles
from pdserve.disagg.auth import channel_credentials, client_interceptors
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.disagg.wire import (
    CHANNEL_OPTIONS,
    REFUSAL_METADATA,
    UNREGISTERED,
    fingerprint_mismatch,
    kv_ranks_problem,
    peer_info_request,
    reason_of_grpc,
)
from pdserve.engine.failure import Failure, FailureReason, RequestFailed

logger = logging.getLogger(__name__)

Metadata = tuple[tuple[str, str], ...]  # a call's gRPC metadata (a traceparent)

MAX_SOURCES = 64  # decode nodes whose channels are kept for migrations from them


class PrefillCallError(RequestFailed):
    """A prefill call failed; the failure names the peer, the stage and the cause."""


def _error(reason: FailureReason, message: str, stage: str, peer: str = "") -> PrefillCallError:
    return PrefillCallError(Failure(reason, message, stage, peer))


def _unregistered(error: grpc.aio.AioRpcError) -> bool:
    trailer = dict(error.trailing_metadata() or ())
    return trailer.get(REFUSAL_METADATA) == UNREGISTERED


def clamp(value: float, floor: float, cap: float) -> float:
    return max(floor, min(value, cap))


@dataclass
class PrefillPeer:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.PrefillServiceStub
    in_flight: int = 0
    failed_at: float | None = None
    info: pb.PeerInfo | None = None
    info_expires: float = 0.0


@dataclass(frozen=True)
class Registration:
    """What decode's probe tells every prefill node about its KV receiver: where it listens
    (`address`), on which backend, with the backend's metadata (nixl: the agent), and who
    learns a verified peer's own transport metadata (`on_peer_metadata`)."""

    address: str = ""
    backend: str = "tcp"
    metadata: bytes = b""
    on_peer_metadata: Callable[[bytes], None] = lambda metadata: None


@dataclass(frozen=True)
class ProbePolicy:
    """A probe's deadline is the request's, clamped to [floor_s, cap_s]; a peer's answer is
    trusted for info_ttl_s; a failed peer is tried again after retry_after_s."""

    floor_s: float = 0.05
    cap_s: float = DEFAULT_PROBE_CAP_S
    info_ttl_s: float = 30.0
    retry_after_s: float = 1.0


class PrefillClient:
    def __init__(
        self,
        addresses: list[str],
        fingerprint: pb.ModelFingerprint,
        registration: Registration | None = None,
        probes: ProbePolicy | None = None,
        planes: tuple[Secret | None, TlsFiles | None] = (None, None),
    ) -> None:
        """`planes`: the cluster secret and TLS files the channels use."""
        if not addresses:
            raise ValueError("a decode node needs at least one --prefill address")
        self.registration = registration or Registration()  # sent to every peer by its probe
        self.probes = probes or ProbePolicy()
        self._secret, self._tls = planes
        self.fingerprint = fingerprint
        self.peers = [self._open(a) for a in addresses]
        # Decode nodes streams migrate here from (a router names them): address -> peer.
        self.sources: collections.OrderedDict[str, PrefillPeer] = collections.OrderedDict()

    def _open(self, address: str) -> PrefillPeer:
        interceptors = client_interceptors(self._secret)
        if self._tls is not None and self._tls.ca:
            credentials = channel_credentials(self._tls)
            channel = grpc.aio.secure_channel(
                address, credentials, options=CHANNEL_OPTIONS, interceptors=interceptors
            )
        else:
            channel = grpc.aio.insecure_channel(
                address, options=CHANNEL_OPTIONS, interceptors=interceptors
            )
        stub = pb_grpc.PrefillServiceStub(channel)  # type: ignore[no-untyped-call]  # generated gRPC code is unannotated
        return PrefillPeer(address, channel, stub)

    def _usable(self, peer: PrefillPeer, now: float) -> bool:
        return peer.failed_at is None or now - peer.failed_at >= self.probes.retry_after_s

    def has_healthy(self) -> bool:
        """Some peer has not failed (requests may be split)."""
        return any(p.failed_at is None for p in self.peers)

    def has_verified(self) -> bool:
        """Some peer answered its probe and has not failed since (what /health reports)."""
        return any(p.failed_at is None and p.info is not None for p in self.peers)

    def knows(self, address: str) -> bool:
        return any(p.address == address for p in self.peers)

    def readdress(self, old: str, new: str) -> PrefillPeer | None:
        """The prefill node at `old` is at `new` now (restarted on another host): calls go
        there from now on, probed first; its old channel is returned for closing (None: `old`
        is not one of ours, nothing changed). Calls in flight on the old one end as they
        would have."""
        for i, peer in enumerate(self.peers):
            if peer.address == old:
                if self.knows(new):
                    self.peers.pop(i)  # already one of ours: the old one is just gone
                else:
                    self.peers[i] = self._open(new)
                return peer
        return None

    def choose(
        self, exclude: tuple[PrefillPeer, ...] = (), prefer: str | None = None
    ) -> PrefillPeer:
        """The `prefer`red peer (a router's choice) while it is usable, else the least-loaded
        usable one."""
        now = time.monotonic()
        usable = [p for p in self.peers if self._usable(p, now) and p not in exclude]
        if not usable:
            names = ", ".join(p.address for p in self.peers)
            message = f"no healthy prefill node (tried {names})"
            raise _error(FailureReason.PEER_UNAVAILABLE, message, "choose prefill")
        preferred = [p for p in usable if p.address == prefer]
        return (
            preferred[0]
            if preferred
            else min(usable, key=lambda p: (p.failed_at is not None, p.in_flight))
        )

    def _mark_failed(self, peer: PrefillPeer) -> None:
        peer.failed_at = time.monotonic()
        peer.info = None  # probe again before trusting it

    async def peer_info(
        self, peer: PrefillPeer, timeout_s: float, mark_failed: bool = True
    ) -> pb.PeerInfo:
        if peer.info is not None and time.monotonic() < peer.info_expires:
            return peer.info
        probe = clamp(timeout_s, self.probes.floor_s, self.probes.cap_s)
        try:
            # wait_for_ready: ride out a reconnect in progress, bounded by the probe deadline.
            info = await peer.stub.GetPeerInfo(
                peer_info_request(
                    self.registration.address,
                    self.registration.metadata,
                    self.registration.backend,
                ),
                timeout=probe,
                wait_for_ready=True,
            )
        except grpc.aio.AioRpcError as e:
            reason = self._probe_failure(e.code(), probe >= timeout_s)
            if mark_failed and reason == FailureReason.PEER_UNAVAILABLE:
                self._mark_failed(peer)
            state = "overloaded" if reason == FailureReason.OVERLOADED else "unreachable"
            message = (
                f"prefill {peer.address} {state} (probe of {probe:.2f}s): "
                f"{e.code().name}: {e.details()}"
            )
            raise _error(reason, message, "peer info probe", peer.address) from e
        mismatch = fingerprint_mismatch(self.fingerprint, info.fingerprint) or kv_ranks_problem(
            info, self.fingerprint.num_kv_heads
        )
        if mismatch:
            message = f"prefill {peer.address} serves a different model or cache layout: {mismatch}"
            raise _error(FailureReason.MODEL_MISMATCH, message, "peer info probe", peer.address)
        if info.transfer_metadata:
            try:
                self.registration.on_peer_metadata(info.transfer_metadata)
            except Exception as e:  # NIXL's own errors for metadata it cannot use
                message = f"prefill {peer.address} sent unusable transfer metadata: {e}"
                raise _error(
                    FailureReason.PEER_UNAVAILABLE, message, "peer info probe", peer.address
                ) from e
        peer.info = info
        peer.info_expires = time.monotonic() + self.probes.info_ttl_s
        return peer.info

    @staticmethod
    def _probe_failure(code: grpc.StatusCode, bounded_by_request: bool) -> FailureReason:
        """A probe that failed: overloaded (busy, not down), the request's own deadline (when
        that bounded the probe), or else unreachable."""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and bounded_by_request:
            return FailureReason.DEADLINE
        if reason_of_grpc(code) == FailureReason.OVERLOADED:
            return FailureReason.OVERLOADED
        return FailureReason.PEER_UNAVAILABLE

    async def prefill(
        self,
        request: pb.PrefillRequest,
        on_chosen: Callable[[str], None] = lambda peer: None,
        prefer: str | None = None,
        untouched: Callable[[], bool] = lambda: False,
        metadata: Metadata = (),
    ) -> tuple[str, pb.PrefillResponse]:
        """Run `request` on the `prefer`red prefill node if it is usable, else the least-loaded
        healthy one (whose address `on_chosen` learns first), the call carrying `metadata`
        (a traceparent). One that is overloaded passes the
        request to the next; so does one that is unreachable while `untouched()` says no byte
        of its KV has arrived (nothing to undo). (Its address, the response.)"""
        tried: tuple[PrefillPeer, ...] = ()
        while True:
            peer = self.choose(tried, prefer)
            try:
                return await self._prefill_on(peer, request, on_chosen, metadata)
            except PrefillCallError as e:
                tried += (peer,)
                now = time.monotonic()
                others = any(self._usable(p, now) for p in self.peers if p not in tried)
                reason = e.failure.reason
                unreachable = reason == FailureReason.PEER_UNAVAILABLE and untouched()
                if not others or not (reason == FailureReason.OVERLOADED or unreachable):
                    raise
                logger.info("request %s: %s; trying another prefill node", request.request_id, e)

    async def migrate(
        self,
        request: pb.PrefillRequest,
        address: str,
        on_chosen: Callable[[str], None] = lambda peer: None,
        metadata: Metadata = (),
    ) -> tuple[str, pb.PrefillResponse]:
        """Fetch the KV of a stream paused on the decode node at `address` (a live migration):
        the same probe (the cluster secret, the model and cache layout checked, this node's KV
        receiver registered) and call as a prefill's, on that node alone."""
        peer = self.sources.get(address)
        if peer is None:
            peer = self.sources[address] = self._open(address)
            while len(self.sources) > MAX_SOURCES:
                _, gone = self.sources.popitem(last=False)
                asyncio.ensure_future(gone.channel.close(grace=None))
        self.sources.move_to_end(address)
        return await self._prefill_on(peer, request, on_chosen, metadata)

    async def _prefill_on(
        self,
        peer: PrefillPeer,
        request: pb.PrefillRequest,
        on_chosen: Callable[[str], None],
        metadata: Metadata = (),
    ) -> tuple[str, pb.PrefillResponse]:
        on_chosen(peer.address)
        remaining = request.deadline_unix - time.time()
        if remaining <= 0:
            message = "deadline passed before calling prefill"
            raise _error(FailureReason.DEADLINE, message, "before prefill", peer.address)
        await self.peer_info(peer, remaining)
        peer.in_flight += 1
        try:
            try:
                response = await peer.stub.Prefill(
                    request, timeout=request.deadline_unix - time.time(), metadata=metadata
                )
            except grpc.aio.AioRpcError as e:
                if not _unregistered(e):
                    raise
                # The peer forgot our receiver (it restarted): register again, retry once.
                peer.info = None
                await self.peer_info(peer, request.deadline_unix - time.time())
                response = await peer.stub.Prefill(
                    request, timeout=request.deadline_unix - time.time(), metadata=metadata
                )
        except grpc.aio.AioRpcError as e:
            reason = reason_of_grpc(e.code())
            if reason == FailureReason.PEER_UNAVAILABLE:
                self._mark_failed(peer)
            message = (
                f"prefill {peer.address} failed for request {request.request_id} "
                f"(unique key {request.unique_key}): {e.code().name}: {e.details()}"
            )
            raise _error(reason, message, "prefill/transfer", peer.address) from e
        finally:
            peer.in_flight -= 1
        peer.failed_at = None
        return peer.address, response

    async def probe_all(self) -> None:
        """Probe peers not yet verified and re-probe failed ones (called periodically), so a
        peer that comes up or comes back is used."""
        now = time.monotonic()
        for peer in self.peers:
            unverified = peer.info is None and peer.failed_at is None
            if unverified or (peer.failed_at is not None and self._usable(peer, now)):
                try:
                    # A peer never reached is not marked failed by the background probe:
                    # only a request's own probe or call decides that (and says so).
                    await self.peer_info(peer, self.probes.cap_s, mark_failed=not unverified)
                    peer.failed_at = None
                    logger.info("prefill %s is reachable again", peer.address)
                except PrefillCallError as e:
                    logger.debug("prefill %s still unreachable: %s", peer.address, e)

    async def close(self) -> None:
        peers = [*self.peers, *self.sources.values()]
        await asyncio.gather(*(p.channel.close() for p in peers), return_exceptions=True)
