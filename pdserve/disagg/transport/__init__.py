"""KV transports: move (request, layer) block lists from prefill memory into decode memory.
`tcp` (zero-copy sockets) and `inprocess` (tests); an RDMA backend plugs in behind the same
interface (`base.py`). `make_sender` and `make_receiver` are the one place a backend is chosen
by name."""

from __future__ import annotations

from pdserve.disagg.transport.base import (
    KVRegions,
    LayerWrite,
    Receive,
    TransferReceiver,
    TransferSender,
    TransportError,
)

BACKENDS = ("tcp", "inprocess")


def _unknown(backend: str) -> ValueError:
    return ValueError(f"unknown transfer backend {backend!r} (choose from {BACKENDS})")


def make_sender(backend: str, regions: KVRegions, testing_delay_s: float = 0.0) -> TransferSender:
    sender: TransferSender
    if backend == "tcp":
        from pdserve.disagg.transport.tcp_sender import TcpSender

        sender = TcpSender(regions)
    elif backend == "inprocess":
        from pdserve.disagg.transport.inprocess import InProcessSender

        sender = InProcessSender(regions)
    else:
        raise _unknown(backend)
    sender.testing_delay_s = testing_delay_s
    return sender


def make_receiver(
    backend: str, receive: Receive, host: str, port: int, max_connections: int
) -> TransferReceiver:
    """A receiver handing frames to `receive`; tcp listens on host:port (0: a free port) and
    serves at most `max_connections` peers at once."""
    if backend == "tcp":
        from pdserve.disagg.transport.tcp_receiver import TcpReceiverServer

        return TcpReceiverServer(receive, host, port, max_connections)
    if backend == "inprocess":
        from pdserve.disagg.transport.inprocess import InProcessReceiver

        return InProcessReceiver(receive)
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
