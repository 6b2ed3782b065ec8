"""In-process transport for tests: the "remote" is a KVReceiver in this process, found by its
address in a registry; bytes are copied block memory to block memory on one worker thread,
through the same validation as TCP."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.resource_store import FrameRejected
from pdserve.disagg.transport.base import KVRegions, LayerWrite, TransferSender, TransportError

Receive = Callable[[pb.TransferFrameHeader, Callable[[list[memoryview]], None]], None]
_REGISTRY: dict[str, Receive] = {}
_LOCK = threading.Lock()


def register_receiver(address: str, receive: Receive) -> None:
    with _LOCK:
        _REGISTRY[address] = receive


def unregister_receiver(address: str) -> None:
    with _LOCK:
        _REGISTRY.pop(address, None)


def _copy(sources: list[memoryview], targets: list[memoryview]) -> None:
    src = np.concatenate([np.frombuffer(v, dtype=np.uint8) for v in sources])
    offset = 0
    for t in targets:
        dst = np.frombuffer(t, dtype=np.uint8)
        dst[:] = src[offset : offset + len(dst)]
        offset += len(dst)


class InProcessSender(TransferSender):
    def __init__(self, regions: KVRegions) -> None:
        self.regions = regions
        self._jobs: queue.Queue[LayerWrite | None] = queue.Queue()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._bytes = 0
        self._thread = threading.Thread(target=self._run, name="kv-send-inproc", daemon=True)
        self._thread.start()

    @property
    def bytes_sent(self) -> int:
        return self._bytes

    def submit(self, write: LayerWrite) -> None:
        self._jobs.put(write)

    def cancel(self, unique_key: str) -> None:
        with self._lock:
            self._cancelled.add(unique_key)

    def forget(self, unique_key: str) -> None:
        with self._lock:
            self._cancelled.discard(unique_key)

    def send_failure(self, peer: str, unique_key: str, error: str) -> None:
        with _LOCK:
            receive = _REGISTRY.get(peer)
        if receive is not None:
            header = pb.TransferFrameHeader(
                kind=pb.TransferFrameHeader.FAILURE, unique_key=unique_key, error=error
            )
            receive(header, lambda views: None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.done(self._write(job))

    def _write(self, job: LayerWrite) -> Exception | None:
        where = f"peer {job.peer}, unique key {job.unique_key}, layer {job.layer}"
        with self._lock:
            if job.unique_key in self._cancelled:
                return TransportError(f"cancelled before sending ({where})")
        remaining = job.deadline - time.time()
        if remaining <= 0 or not job.event.wait(remaining):
            return TransportError(f"deadline passed before layer was ready ({where})")
        with self._lock:
            if job.unique_key in self._cancelled:  # cancelled while the layer computed
                return TransportError(f"cancelled before sending ({where})")
        if self.testing_delay_s:
            time.sleep(self.testing_delay_s)
        with _LOCK:
            receive = _REGISTRY.get(job.peer)
        if receive is None:
            return TransportError(f"no in-process receiver at {job.peer} ({where})")
        header = pb.TransferFrameHeader(
            kind=pb.TransferFrameHeader.DATA,
            unique_key=job.unique_key,
            layer=job.layer,
            block_ids=job.dst_blocks,
            head_count=self.regions.num_kv_heads,
            block_bytes=self.regions.block_bytes,
        )
        sources = self.regions.views(job.layer, job.src_blocks)
        try:
            receive(header, lambda targets: _copy(sources, targets))
        except FrameRejected as e:
            return TransportError(f"receiver rejected the frame ({where}): {e}")
        self._bytes += sum(len(v) for v in sources)
        return None

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
