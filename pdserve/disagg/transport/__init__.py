"""KV transports: move (request, layer) block lists from prefill memory into decode memory.
`tcp` (zero-copy sockets), `nixl` (NIXL/UCX: RDMA where the fabric has it, shared memory on one
host; decode pulls) and `inprocess` (tests), behind one interface (`base.py`). `make_sender`
and `make_receiver` are the one place a backend is chosen by name."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.config import NodeConfig, Secret
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
    checksum: bool = False,
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
    sender.checksum = checksum
    return sender


def make_receiver(
    config: NodeConfig,
    sink: FrameSink,
    regions: KVRegions | None = None,
    expecting: Callable[[], bool] = lambda: True,
) -> TransferReceiver:
    """A receiver on `config`'s transfer backend handing frames to `sink` (the KV receiver):
    tcp listens on --transfer-host/--transfer-port (0: a free port), serves at most
    --max-transfer-connections authenticated peers at once and closes idle ones; nixl
    registers `regions` (the blocks it reads into) with its agent and polls for frames quickly
    only while `expecting()`."""
    backend = config.transfer_backend
    if backend == "tcp":
        from pdserve.disagg.transport.tcp_receiver import ReceiverLimits, TcpReceiverServer

        limits = ReceiverLimits(config.max_transfer_connections, config.transfer_idle_timeout_s)
        return TcpReceiverServer(
            sink.receive, config.transfer_host, config.transfer_port, config.cluster_secret, limits
        )
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
