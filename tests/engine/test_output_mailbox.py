"""The output mailbox: an unread stream holds one output, not one per token, and a reader
that stops taking outputs is reported once after the idle limit (on an injected clock)."""

from __future__ import annotations

import asyncio

from pdserve.engine.output_mailbox import OutputMailbox
from pdserve.engine.outputs import RequestOutput


def output(n: int, finished: bool = False) -> RequestOutput:
    """The n-th output of a request producing token i with text "t{i} " at step i."""
    tokens = list(range(n))
    text = "".join(f"t{i} " for i in tokens)
    return RequestOutput("r", [1], tokens, text, f"t{n - 1} ", [0.0] * n, finished, None)


def test_an_unread_stream_holds_one_output_with_every_delta() -> None:
    async def run() -> None:
        box = OutputMailbox()
        for n in range(1, 2001):
            box.put(output(n, finished=n == 2000))
            assert box.pending is not None and len(box.pending.token_ids) == n  # one output held
        assert box.merged == 1999
        out = await box.get()
        assert out.finished and out.token_ids == list(range(2000))
        assert out.delta_text == out.text  # no text lost by merging
        assert box.pending is None

    asyncio.run(run())


def test_a_reader_idle_past_the_limit_is_reported_once() -> None:
    async def run() -> None:
        now = [0.0]
        reported: list[float] = []
        box = OutputMailbox(30.0, lambda: reported.append(now[0]), clock=lambda: now[0])
        box.put(output(1))
        assert (await box.get()).token_ids == [0]  # read at t=0
        for t, n in ((10.0, 2), (20.0, 3), (29.0, 4)):
            now[0] = t
            box.put(output(n))
        assert reported == []  # unread, but within the limit
        now[0] = 31.0
        box.put(output(5))
        box.put(output(6))
        assert reported == [31.0]
        out = await box.get()
        assert out.token_ids == list(range(6)) and out.delta_text == "t1 t2 t3 t4 t5 "

    asyncio.run(run())
