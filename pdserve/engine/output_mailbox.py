"""Where one request's outputs wait for a reader on an event loop, bounded whatever the reader
does: an output that arrives while the previous one is unread replaces it (outputs carry all
tokens so far; the text deltas are joined), so an unread stream holds one output, not one per
token. A reader that takes nothing for `idle_limit_s` while outputs keep coming is reported
once through `on_idle` (the owner aborts the request).

Lifecycle: made by the reader on its loop -> `put` from the loop (the engine thread hands over
with `loop_post.post`, batched per engine turn) -> `get` until a finished output is taken.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from pdserve.engine.failure import Failure, FailureReason
from pdserve.engine.outputs import RequestOutput


def reader_gone(request_id: str) -> Failure:
    """Why a request whose reader stopped taking its outputs was ended."""
    message = f"request {request_id}: the client stopped reading its stream"
    return Failure(FailureReason.CANCELLED, message, "streaming")


class OutputMailbox:
    def __init__(
        self,
        idle_limit_s: float | None = None,
        on_idle: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pending: RequestOutput | None = None
        self._ready = asyncio.Event()
        self._idle_limit_s = idle_limit_s
        self._on_idle = on_idle
        self._clock = clock
        self._last_read = clock()
        self._idle_reported = False
        self.merged = 0  # outputs folded into a later one because nobody read them

    @property
    def pending(self) -> RequestOutput | None:
        """The output waiting to be read, if any (what this mailbox holds)."""
        return self._pending

    def put(self, out: RequestOutput) -> None:
        old = self._pending
        if old is not None:
            self.merged += 1
            out = dataclasses.replace(
                out, delta_text=old.delta_text + out.delta_text, timings=out.timings or old.timings
            )
            self._check_idle()
        self._pending = out
        self._ready.set()

    def _check_idle(self) -> None:
        limit = self._idle_limit_s
        if limit is None or self._idle_reported or self._clock() - self._last_read < limit:
            return
        self._idle_reported = True
        self._on_idle()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        out = self._pending
        assert out is not None
        self._pending = None
        self._ready.clear()
        self._last_read = self._clock()
        return out
