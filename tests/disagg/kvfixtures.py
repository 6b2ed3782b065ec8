"""Small KV regions, a live TCP receiver and a controllable layer event for transfer tests."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from pdserve.config import Secret
from pdserve.disagg.kv_receiver import KVReceiver
from pdserve.disagg.resource_store import ResourceStore
from pdserve.disagg.transport.handshake import open_handshake
from pdserve.disagg.transport.regions import KVRegions
from pdserve.disagg.transport.tcp_receiver import ReceiverLimits, TcpReceiverServer

NUM_LAYERS = 3
NUM_BLOCKS = 8
SHAPE = (NUM_BLOCKS, 2, 2, 4, 8)  # blocks, K/V, kv heads, block size, head dim


def connect(address: str, secret: Secret | None = None) -> socket.socket:
    """A raw transfer connection to `address`, past the link's handshake (as a sender)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    open_handshake(sock, secret)
    sock.settimeout(5)
    return sock


def layers_received(store: ResourceStore, unique_key: str) -> set[int]:
    progress = store.progress(unique_key)
    return set(progress.layers_done) if progress is not None else set()


def wait_for_layer(store: ResourceStore, unique_key: str, layer: int, deadline: float) -> bool:
    """True once `layer` of `unique_key` has fully arrived (polls the store's progress)."""
    while layer not in layers_received(store, unique_key):
        if time.time() >= deadline:
            return False
        time.sleep(0.005)
    return True


def writing(store: ResourceStore, unique_key: str) -> int:
    progress = store.progress(unique_key)
    return progress.writing if progress is not None else 0


class ManualEvent:
    """An AsyncEvent the test fires by hand."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def fire(self) -> None:
        self._event.set()

    def ready(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)


def caches(fill: float | None = None, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(NUM_LAYERS):
        t = torch.randn(SHAPE, generator=g).to(torch.bfloat16)
        if fill is not None:
            t.fill_(fill)
        out.append(t)
    return out


def record_frames(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """(key, first layer, layers) of every frame a KV receiver made from now on opens: a spy
    that lets the real one do the work."""
    frames: list[tuple[str, int, int]] = []
    real_open = KVReceiver.open

    def recording_open(self, header, link=0):  # type: ignore[no-untyped-def]
        frames.append((header.unique_key, header.layer, header.layer_count or 1))
        return real_open(self, header, link)

    monkeypatch.setattr(KVReceiver, "open", recording_open)
    return frames


class Receiver:
    """Decode side: target caches (zeros), store, KVReceiver and a TCP receiver server."""

    def __init__(
        self, max_connections: int = 64, secret: Secret | None = None, verify: bool = False
    ) -> None:
        self.caches = caches(fill=0.0)
        self.regions = KVRegions(self.caches)
        self.store = ResourceStore()
        self.receiver = KVReceiver(self.store, self.regions, verify=verify)
        self.server = TcpReceiverServer(
            self.receiver.receive, secret=secret, limits=ReceiverLimits(max_connections)
        )
        self.address = self.server.address

    def register(self, key: str, blocks: list[int], timeout: float = 10.0) -> None:
        self.store.register(
            key,
            f"req-{key}",
            blocks,
            len(blocks),
            NUM_LAYERS,
            self.regions.block_bytes,
            time.time() + timeout,
        )

    def snapshot(self) -> list[torch.Tensor]:
        return [c.clone() for c in self.caches]

    def close(self) -> None:
        self.server.stop()
