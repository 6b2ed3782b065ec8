"""Decode's client for prefill nodes: one pooled grpc.aio channel per address, the peer's info
(tp size, model fingerprint) probed with a clamped deadline and cached with a TTL, and the
choice of the least-loaded healthy node. A node that fails is not chosen again until a retry
interval has passed (then one request probes it). Lives on the node's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
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
FINGERPRINT_FIELDS = (
    "architecture",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "block_size",
)


class PrefillCallError(RuntimeError):
    """A prefill call failed; the message names the peer, the stage and the cause."""

    def __init__(self, message: str, stage: str, timeout: bool = False) -> None:
        super().__init__(message)
        self.stage = stage
        self.timeout = timeout


def clamp(value: float, floor: float, cap: float) -> float:
    return max(floor, min(value, cap))


def fingerprint_mismatch(local: pb.ModelFingerprint, remote: pb.ModelFingerprint) -> str | None:
    diffs = [
        f"{name}: decode={getattr(local, name)!r} prefill={getattr(remote, name)!r}"
        for name in FINGERPRINT_FIELDS
        if getattr(local, name) != getattr(remote, name)
    ]
    return "; ".join(diffs) if diffs else None


@dataclass
class PrefillPeer:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.PrefillServiceStub
    in_flight: int = 0
    failed_at: float | None = None
    info: pb.PeerInfo | None = None
    info_expires: float = 0.0


class PrefillClient:
    def __init__(
        self,
        addresses: list[str],
        fingerprint: pb.ModelFingerprint,
        probe_floor_s: float = 0.05,
        probe_cap_s: float = 2.0,
        info_ttl_s: float = 30.0,
        retry_after_s: float = 1.0,
    ) -> None:
        if not addresses:
            raise ValueError("a decode node needs at least one --prefill address")
        self.fingerprint = fingerprint
        self.probe_floor_s = probe_floor_s
        self.probe_cap_s = probe_cap_s
        self.info_ttl_s = info_ttl_s
        self.retry_after_s = retry_after_s
        self.peers = [self._open(a) for a in addresses]

    @staticmethod
    def _open(address: str) -> PrefillPeer:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return PrefillPeer(address, channel, pb_grpc.PrefillServiceStub(channel))

    def _usable(self, peer: PrefillPeer, now: float) -> bool:
        return peer.failed_at is None or now - peer.failed_at >= self.retry_after_s

    def has_healthy(self) -> bool:
        """Some peer has not failed (requests may be split)."""
        return any(p.failed_at is None for p in self.peers)

    def has_verified(self) -> bool:
        """Some peer answered its probe and has not failed since (what /health reports)."""
        return any(p.failed_at is None and p.info is not None for p in self.peers)

    def choose(self) -> PrefillPeer:
        now = time.monotonic()
        usable = [p for p in self.peers if self._usable(p, now)]
        if not usable:
            names = ", ".join(p.address for p in self.peers)
            raise PrefillCallError(f"no healthy prefill node (tried {names})", "choose prefill")
        return min(usable, key=lambda p: (p.failed_at is not None, p.in_flight))

    def _mark_failed(self, peer: PrefillPeer) -> None:
        peer.failed_at = time.monotonic()
        peer.info = None  # probe again before trusting it

    async def peer_info(
        self, peer: PrefillPeer, timeout_s: float, mark_failed: bool = True
    ) -> pb.PeerInfo:
        if peer.info is not None and time.monotonic() < peer.info_expires:
            return peer.info
        probe = clamp(timeout_s, self.probe_floor_s, self.probe_cap_s)
        try:
            # wait_for_ready: ride out a reconnect in progress, bounded by the probe deadline.
            info = await peer.stub.GetPeerInfo(
                pb.PeerInfoRequest(), timeout=probe, wait_for_ready=True
            )
        except grpc.aio.AioRpcError as e:
            if mark_failed:
                self._mark_failed(peer)
            raise PrefillCallError(
                f"prefill {peer.address} unreachable (stage: peer info probe, {probe:.2f}s): "
                f"{e.code().name}: {e.details()}",
                "peer info probe",
                timeout=e.code() == grpc.StatusCode.DEADLINE_EXCEEDED,
            ) from e
        mismatch = fingerprint_mismatch(self.fingerprint, info.fingerprint)
        if mismatch:
            raise PrefillCallError(
                f"prefill {peer.address} serves a different model or cache layout: {mismatch}",
                "peer info probe",
            )
        peer.info = info
        peer.info_expires = time.monotonic() + self.info_ttl_s
        return info

    async def prefill(self, request: pb.PrefillRequest) -> tuple[str, pb.PrefillResponse]:
        """Run `request` on the least-loaded healthy prefill node; (its address, response)."""
        peer = self.choose()
        remaining = request.deadline_unix - time.time()
        if remaining <= 0:
            raise PrefillCallError("deadline passed before calling prefill", "before prefill", True)
        await self.peer_info(peer, remaining)
        peer.in_flight += 1
        try:
            response = await peer.stub.Prefill(request, timeout=request.deadline_unix - time.time())
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
                self._mark_failed(peer)
            raise PrefillCallError(
                f"prefill {peer.address} failed for request {request.request_id} "
                f"(unique key {request.unique_key}, stage: prefill/transfer): "
                f"{code.name}: {e.details()}",
                "prefill",
                timeout=code == grpc.StatusCode.DEADLINE_EXCEEDED,
            ) from e
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
                    await self.peer_info(peer, self.probe_cap_s, mark_failed=not unverified)
                    peer.failed_at = None
                    logger.info("prefill %s is reachable again", peer.address)
                except PrefillCallError as e:
                    logger.debug("prefill %s still unreachable: %s", peer.address, e)

    async def close(self) -> None:
        await asyncio.gather(*(p.channel.close() for p in self.peers), return_exceptions=True)
