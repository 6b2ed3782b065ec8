"""KV transports: move (request, layer) block lists from prefill memory into decode memory.
`tcp` (zero-copy sockets), `nixl` (NIXL/UCX: RDMA where the fabric has it, shared memory on one
host; decode pulls) and `inprocess` (tests), behind one interface (`base.py`). `make_sender`
and `make_receiver` are the one place a backend is chosen by name."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.config import DEFAULT_TRANSFER_IDLE_S, Secret
from pdserve.disagg.transport.base import (
    FrameSink,
    LayerWrite,
    TransferReceiver,
    TransferSender,
    TransportError,
)
from pdserve.disagg.transport.regions import KVRegions

BACKENDS = ("tcp", "nixl", "inprocess")


def _unknown(backend: str) -> ValueError:
    return ValueError(f"unknown transfer backend {backend!r} (choose from {BACKENDS})")


def make_sender(
    backend: str,
    regions: KVRegions,
    testing_delay_s: float = 0.0,
    secret: Secret | None = None,
) -> TransferSender:
    sender: TransferSender
    if backend == "tcp":
        from pdserve.disagg.transport.tcp_sender import TcpSender

        sender = TcpSender(regions, secret)
    elif backend == "nixl":
        from pdserve.disagg.transport.nixl_sender import NixlSender

        sender = NixlSender(regions)
    elif backend == "inprocess":
        from pdserve.disagg.transport.inprocess import InProcessSender

        sender = InProcessSender(regions)
    else:
        raise _unknown(backend)
    sender.testing_delay_s = testing_delay_s
    return sender


def make_receiver(
    backend: str,
    sink: FrameSink,
    host: str,
    port: int,
    max_connections: int,
    secret: Secret | None = None,
    idle_timeout_s: float = DEFAULT_TRANSFER_IDLE_S,
    regions: KVRegions | None = None,
    expecting: Callable[[], bool] = lambda: True,
) -> TransferReceiver:
    """A receiver handing frames to `sink` (the KV receiver); tcp listens on host:port (0: a
    free port), serves at most `max_connections` authenticated peers at once and closes idle
    ones; nixl registers `regions` (the blocks it reads into) with its agent and polls for
    frames quickly only while `expecting()`."""
    if backend == "tcp":
        from pdserve.disagg.transport.tcp_receiver import TcpReceiverServer

        return TcpReceiverServer(sink.receive, host, port, max_connections, secret, idle_timeout_s)
    if backend == "nixl":
        from pdserve.disagg.transport.nixl_receiver import NixlReceiver

        assert regions is not None, "the nixl receiver registers the KV regions"
        return NixlReceiver(sink.open, regions, expecting)
    if backend == "inprocess":
        from pdserve.disagg.transport.inprocess import InProcessReceiver

        return InProcessReceiver(sink.receive)
    raise _unknown(backend)


__all__ = [
    "BACKENDS",
    "KVRegions",
    "LayerWrite",
    "TransferReceiver",
    "TransferSender",
    "TransportError",
    "make_receiver",
    "make_sender",
]
