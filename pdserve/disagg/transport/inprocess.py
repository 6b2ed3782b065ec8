"""In-process transport for tests: the same writes, copied between two engines in one process.
A receiver registers its `Receive` function under an `inprocess-...` address; the sender's one
thread looks it up per write."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable

import numpy as np

from pdserve.disagg.transport.base import (
    FrameCorrupt,
    FrameRejected,
    LayerWrite,
    Receive,
    TransferReceiver,
    TransferSender,
    TransportError,
)
from pdserve.disagg.transport.regions import KVRegions
from pdserve.disagg.wire import failure_header
from pdserve.engine.failure import Failure, FailureReason

_REGISTRY: dict[str, Receive] = {}
_LOCK = threading.Lock()


def _lookup(address: str) -> Receive | None:
    with _LOCK:
        return _REGISTRY.get(address)


def _copy(sources: list[memoryview], targets: Iterable[memoryview]) -> None:
    src = np.concatenate([np.frombuffer(v, dtype=np.uint8) for v in sources])
    offset = 0
    for t in targets:
        dst = np.frombuffer(t, dtype=np.uint8)
        dst[:] = src[offset : offset + len(dst)]
        offset += len(dst)


class InProcessReceiver(TransferReceiver):
    def __init__(self, receive: Receive) -> None:
        self.address = f"inprocess-{id(self)}"
        with _LOCK:
            _REGISTRY[self.address] = receive

    def stop(self) -> None:
        with _LOCK:
            _REGISTRY.pop(self.address, None)


class InProcessSender(TransferSender):
    def __init__(self, regions: KVRegions) -> None:
        super().__init__()
        self.regions = regions
        self._jobs: queue.Queue[LayerWrite | None] = queue.Queue()
        self._bytes = 0
        self._thread = threading.Thread(target=self._run, name="kv-send-inproc", daemon=True)
        self._thread.start()

    @property
    def bytes_sent(self) -> int:
        return self._bytes

    def submit(self, write: LayerWrite) -> None:
        self._jobs.put(write)

    def send_failure(self, peer: str, unique_key: str, failure: Failure) -> None:
        receive = _lookup(peer)
        if receive is not None:
            receive(failure_header(unique_key, failure), lambda views, deadline: None, 0)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.done(self._write(job))

    def _write(self, job: LayerWrite) -> TransportError | None:
        if self.is_cancelled(job.unique_key):
            return job.error(FailureReason.CANCELLED, "cancelled before sending", "sending")
        remaining = job.deadline - time.time()
        if remaining <= 0 or not job.event.wait(remaining):
            message = "deadline passed before layer was ready"
            return job.error(FailureReason.DEADLINE, message, "sending")
        error = self.held_back(job)  # cancelled while the layer computed?
        if error is not None:
            return error
        receive = _lookup(job.peer)
        if receive is None:
            return job.error(FailureReason.PEER_UNAVAILABLE, "no in-process receiver", "connect")
        header, views = self.data_frame([job])
        sources = list(views)
        try:
            receive(header, lambda targets, _: _copy(sources, targets), 0)
        except (FrameRejected, FrameCorrupt) as e:
            return job.error(FailureReason.TRANSFER_FAILED, f"receiver rejected: {e}", "sending")
        self._bytes += sum(len(v) for v in sources)
        return None

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
