"""The engine is loaded, warmed and stepped on one thread (the node's engine thread): a torch
op on a second thread would give libgomp a second thread pool, after which it stops spinning
between parallel regions and every region ends in futex sleeps (benchmarks/engine_thread.py
measures the cost). Checked on a real decode node serving in this process."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.engine.llm_engine import LLMEngine
from tests.disagg.cluster import decode_stub, inprocess_decode


def test_the_engine_is_built_on_the_thread_that_steps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built_on: list[int] = []
    stepped_on: set[int] = set()
    init, run_step = LLMEngine.__init__, LLMEngine.run_step

    def recording_init(self: LLMEngine, *args: object, **kwargs: object) -> None:
        built_on.append(threading.get_ident())
        init(self, *args, **kwargs)  # type: ignore[arg-type]

    def recording_step(self: LLMEngine) -> list:  # type: ignore[type-arg]
        if self.has_compute():
            stepped_on.add(threading.get_ident())
        return run_step(self)

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    monkeypatch.setattr(LLMEngine, "run_step", recording_step)
    with inprocess_decode(tmp_path) as node:
        assert node.grpc is not None
        sampling = pb.SamplingConfig(max_tokens=3, temperature=0.0, ignore_eos=True)
        request = pb.GenerateRequest(token_ids=[5, 6, 7, 8], sampling=sampling)
        tokens = [t for r in decode_stub(node.grpc.address).Generate(request) for t in r.token_ids]
        assert len(tokens) == 3
        engine_thread = node.engine_thread.call(threading.get_ident).result(10)
    assert built_on == [engine_thread]
    assert stepped_on == {engine_thread}
    assert engine_thread != threading.get_ident()
