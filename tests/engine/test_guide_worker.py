"""Structured-output compiles in worker processes (SmolLM2's tokenizer): a guide compiled there
gives the same matcher as one compiled in process; a guide whose compile runs past the time
cap (a 13 KB schema that takes ~11 s) is refused and its worker killed; a worker that dies
mid-compile (as a native crash would) fails that guide alone, and the next one compiles."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from pdserve.engine.guide_worker import GuideWorkers
from pdserve.engine.sequence import Guide, GuideKind
from pdserve.engine.structured import Grammars, GuideError
from pdserve.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

SLOW = Guide(
    GuideKind.JSON_SCHEMA,
    json.dumps(
        {
            "type": "object",
            "properties": {
                f"p{i}": {"type": "string", "pattern": "[a-z]{1,40}"} for i in range(200)
            },
            "required": [f"p{i}" for i in range(200)],
        }
    ),
)
QUICK = Guide(GuideKind.REGEX, "(yes|no), [0-9]{1,3}")


def accepts(grammars: Grammars, guide: Guide, text: str, tokenizer: Tokenizer) -> bool:
    matcher = grammars.matcher(guide)
    return all(matcher.accept_token(t) for t in tokenizer.encode(text))


def test_compiles_in_a_worker_within_the_time_cap_and_survive_a_crash(
    smollm_fp32_dir: Path,
) -> None:
    tokenizer = Tokenizer(smollm_fp32_dir)
    grammars = Grammars(tokenizer.hf, 49152, sorted(tokenizer.eos_token_ids))
    local = Grammars(tokenizer.hf, 49152, sorted(tokenizer.eos_token_ids))
    workers = GuideWorkers(grammars.info.serialize_json(), timeout_s=1.0)

    async def scenario() -> None:
        grammars.add_compiled(QUICK, await workers.compile(QUICK))
        assert grammars.has(QUICK)
        for text in ("yes, 42", "no, 7", "maybe, 1"):  # as compiled in this process
            assert accepts(grammars, QUICK, text, tokenizer) == accepts(
                local, QUICK, text, tokenizer
            )
        with pytest.raises(GuideError, match="longer than 1 s"):
            await workers.compile(SLOW)
        assert workers.killed == 1 and not grammars.has(SLOW)
        # A worker killed mid-compile (a crash): that guide fails, alone.
        crashed = asyncio.ensure_future(workers.compile(SLOW))
        while workers._pool is None:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        for process in list(workers._pool._processes.values()):  # type: ignore[attr-defined]
            os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(GuideError, match="crashed"):
            await crashed
        assert workers.killed == 2
        again = Guide(GuideKind.REGEX, "[0-9]+")
        grammars.add_compiled(again, await workers.compile(again))
        assert accepts(grammars, again, "123", tokenizer)

    try:
        asyncio.run(scenario())
    finally:
        workers.close()
