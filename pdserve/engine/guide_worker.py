"""Structured-output compiles in a worker process: a guide (schema, regex, grammar) is compiled
by xgrammar in a spawned process and comes back as the compiled grammar's JSON, so a compile
that runs past its time cap is ended by killing the worker (threads cannot be stopped), and one
that crashes the compiler (a native fault) takes only the worker. The node's process never
compiles an unknown guide itself.

Cost (SmolLM2's 49k-token vocabulary): the worker starts once, on the first guide (~3 s: it
imports xgrammar, which imports torch, and reads the tokenizer's info); each new guide then
costs its compile plus ~40 ms to serialize and read back; a guide compiled before is a cache
hit in the node's process (`Grammars`). Lifecycle: started lazily -> compiles (at most
`WORKERS` at once) -> on a timeout or a crash every worker is killed and the pool replaced
(compiles of other requests caught in it are retried once) -> `close`."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from pdserve.engine.sequence import Guide, GuideKind
from pdserve.engine.structured import GuideError, compile_with

WORKERS = 2
COMPILE_TIMEOUT_S = 10.0  # a guide that takes longer is refused (400)
START_TIMEOUT_S = 120.0  # a worker importing xgrammar (and torch) on a busy machine

_compiler: Any = None  # the worker's xgrammar GrammarCompiler


def _start(tokenizer_info_json: str) -> None:
    import xgrammar as xgr

    global _compiler
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    _compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _ready() -> bool:
    return _compiler is not None


def _compile(kind: str, spec: str) -> tuple[bool, str]:
    """(True, the compiled grammar's JSON) or (False, why it cannot be compiled)."""
    try:
        return True, compile_with(_compiler, Guide(GuideKind(kind), spec)).serialize_json()
    except GuideError as e:
        return False, str(e)


class GuideWorkers:
    def __init__(self, tokenizer_info_json: str, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self._info = tokenizer_info_json
        self.timeout_s = timeout_s
        self._pool: ProcessPoolExecutor | None = None
        self._starting: asyncio.Lock | None = None
        self.killed = 0  # worker pools ended by a timeout or a crash

    async def _ready_pool(self) -> ProcessPoolExecutor:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._pool is None:
                pool = ProcessPoolExecutor(
                    WORKERS,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start,
                    initargs=(self._info,),
                )
                ready = [asyncio.wrap_future(pool.submit(_ready)) for _ in range(WORKERS)]
                await asyncio.wait_for(asyncio.gather(*ready), START_TIMEOUT_S)
                self._pool = pool
            return self._pool

    async def compile(self, guide: Guide) -> str:
        """The compiled grammar's JSON; GuideError for a guide that cannot be compiled,
        takes longer than `timeout_s`, or crashes the compiler."""
        for _attempt in range(2):
            pool = await self._ready_pool()
            future = pool.submit(_compile, guide.kind.value, guide.spec)
            try:
                ok, out = await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
            except TimeoutError:
                self._kill(pool)
                raise GuideError(
                    f"{guide.kind.value}: compiling took longer than {self.timeout_s:.0f} s"
                ) from None
            except BrokenProcessPool:
                if pool is self._pool:  # this guide crashed it
                    self._kill(pool)
                    raise GuideError(
                        f"{guide.kind.value}: the structured-output compiler crashed on it"
                    ) from None
                continue  # another request's guide ended the pool: once more, in the new one
            if not ok:
                raise GuideError(out)
            return out
        raise GuideError(f"{guide.kind.value}: the structured-output compiler failed")

    def _kill(self, pool: ProcessPoolExecutor) -> None:
        if pool is self._pool:
            self._pool = None
            self.killed += 1
        processes = list(getattr(pool, "_processes", {}).values())  # the pool has no kill()
        for p in processes:
            with contextlib.suppress(Exception):
                p.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        if self._pool is not None:
            self._kill(self._pool)
