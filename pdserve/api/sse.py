"""A streamed response as server-sent events: chunks for every choice as its outputs arrive
(interleaved), an error event if a choice fails, optional usage, then `data: [DONE]`. A stream
that ends early (the client went away) aborts every choice still running. `client_gone`
watches a request whose body was read for its client's disconnect."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request

from pdserve.api.protocol import APIError, LogprobRequest
from pdserve.api.render import Renderer
from pdserve.api.run import Choice, Run
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import SequenceStatus

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
MIGRATED = SequenceStatus.FINISHED_MIGRATED.value


def event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def stream_events(
    run: Run,
    render: Renderer,
    logprobs: LogprobRequest,
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    finished = 0
    pending: dict[asyncio.Future[RequestOutput], Choice] = {}
    try:
        firsts = [d for c in run.choices if (d := render.first_delta(c.index)) is not None]
        if firsts:
            yield event(render.chunk(run, firsts, run.usage() if continuous_usage else None))
        pending.update({asyncio.ensure_future(run.next(c)): c for c in run.choices})
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                c = pending.pop(fut)
                out = fut.result()
                if out.failure is not None:
                    yield event(APIError.of(out.failure).body())
                    yield DONE
                    return
                if out.finish_reason == MIGRATED:  # paused for another node: the router
                    # resumes it there; what is left of it comes from there
                    if out.delta_text:
                        sent, c.sent_tokens = c.sent_tokens, len(out.token_ids)
                        delta = render.delta(c.index, replace(out, finished=False), sent, logprobs)
                        yield event(render.chunk(run, [delta]))
                    finished += 1
                    return
                if out.delta_text or out.finished:  # tokens whose text is held back (a
                    # possible stop string) go out with the next chunk that carries text
                    sent, c.sent_tokens = c.sent_tokens, len(out.token_ids)
                    delta = render.delta(c.index, out, sent, logprobs)
                    usage = run.usage() if continuous_usage else None
                    yield event(render.chunk(run, [delta], usage))
                if out.finished:
                    finished += 1
                else:
                    pending[asyncio.ensure_future(run.next(c))] = c
        if run.choices and include_usage:
            yield event(render.chunk(run, [], run.usage()))
        yield DONE
    finally:
        if finished < len(run.choices):
            logger.info("stream %s ended early (client gone?); aborting", run.id)
            for fut in pending:
                fut.cancel()
            await run.abort()


async def client_gone(http: Request) -> None:
    """Returns when the client disconnects (its body has been read, so the next ASGI message
    is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
