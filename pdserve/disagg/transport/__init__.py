"""KV transports: move (request, layer) block lists from prefill memory into decode memory.
`tcp` (zero-copy sockets) and `inprocess` (tests); an RDMA backend plugs in behind the same
interface (`base.py`)."""

from __future__ import annotations

from pdserve.disagg.transport.base import KVRegions, LayerWrite, TransferSender, TransportError

BACKENDS = ("tcp", "inprocess")


def make_sender(backend: str, regions: KVRegions, testing_delay_s: float = 0.0) -> TransferSender:
    sender: TransferSender
    if backend == "tcp":
        from pdserve.disagg.transport.tcp import TcpSender

        sender = TcpSender(regions)
    elif backend == "inprocess":
        from pdserve.disagg.transport.inprocess import InProcessSender

        sender = InProcessSender(regions)
    else:
        raise ValueError(f"unknown transfer backend {backend!r} (choose from {BACKENDS})")
    sender.testing_delay_s = testing_delay_s
    return sender


__all__ = ["BACKENDS", "KVRegions", "LayerWrite", "TransferSender", "TransportError", "make_sender"]
