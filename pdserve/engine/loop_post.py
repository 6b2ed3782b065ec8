"""Calls from the engine thread to event loops, one wake-up per loop per engine turn.

Every `call_soon_threadsafe` wakes its loop's thread. On a machine whose cores all run the
engine's compute threads, each wake-up preempts one of them, and the other waits for it at the
next barrier: per-request hand-offs (a token of each of 4 streams, every step) cost a served
run measurably more than the same steps offline. Inside `one_wakeup_per_loop` the engine thread
collects its calls per loop and hands each loop its batch in one go when the block ends; outside
it (any other thread, or the engine thread between turns) `post` is `call_soon_threadsafe`.

Lifecycle: the engine thread enters `one_wakeup_per_loop` around a phase of its turn -> the
callbacks it runs `post` -> on leaving, each loop gets one call that runs its batch in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

_local = threading.local()  # .batches: {loop: [call]} while a block is open on this thread


def post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Run `fn(*args)` on `loop`: at the end of the enclosing block, or now if there is none."""
    batches: dict[asyncio.AbstractEventLoop, list[Callable[[], Any]]] | None = getattr(
        _local, "batches", None
    )
    if batches is None:
        loop.call_soon_threadsafe(fn, *args)
    else:
        batches.setdefault(loop, []).append(functools.partial(fn, *args))


def _run_all(calls: list[Callable[[], Any]]) -> None:
    for call in calls:  # one failing call must not drop the others' outputs
        try:
            call()
        except Exception:
            logger.exception("a hand-off from the engine thread failed")


@contextlib.contextmanager
def one_wakeup_per_loop() -> Iterator[None]:
    """Collect this thread's `post`s and hand them over, one batch per loop, on leaving. A
    loop that is closed raises as `call_soon_threadsafe` would, after the others got theirs."""
    outer = getattr(_local, "batches", None)
    if outer is not None:  # nested: the outer block hands over
        yield
        return
    _local.batches = {}
    try:
        yield
    finally:
        batches, _local.batches = _local.batches, None
        failed: RuntimeError | None = None
        for loop, calls in batches.items():
            try:
                loop.call_soon_threadsafe(_run_all, calls)
            except RuntimeError as e:  # closed
                failed = failed or e
        if failed is not None:
            raise failed
