"""Layer-ready events: the model runner records one after each layer wrote its KV, and the KV
sender waits on it before reading that layer's blocks. On CPU the write has happened when the
callback runs, so the event is complete at once; on a GPU it is a CUDA event recorded on the
compute stream. Tests use a controllable event (tests/disagg/events.py)."""

from __future__ import annotations

from typing import Protocol


class AsyncEvent(Protocol):
    def ready(self) -> bool:
        """True once the work recorded before the event has finished. Never blocks."""
        ...

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds; True if the event completed."""
        ...


class CompletedEvent:
    """CPU: ops are synchronous, so the layer's KV is in memory when the event is made."""

    def ready(self) -> bool:
        return True

    def wait(self, timeout: float) -> bool:
        return True


class CudaEvent:
    """Recorded on the current CUDA stream when created."""

    def __init__(self) -> None:
        import torch

        self._event = torch.cuda.Event()
        self._event.record()

    def ready(self) -> bool:
        return bool(self._event.query())

    def wait(self, timeout: float) -> bool:
        # torch has no timed wait on an event; synchronize() blocks until it completes.
        self._event.synchronize()
        return True


def make_layer_event(device: str = "cpu") -> AsyncEvent:
    return CudaEvent() if device.startswith("cuda") else CompletedEvent()
