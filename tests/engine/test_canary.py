"""The live canary (--canary-rate): completed requests recomputed when the engine is idle and
compared with what was served. A fault that perturbs one decode step's logits of one request
makes the canary report exactly that request (logged, counted); with no fault, 200 requests
under --deterministic give 200 matches; a check in flight gives way to a user request that
arrives; the checks' outputs reach no one; memory is bounded."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from pdserve.config import CacheConfig, ConfigError, EngineConfig
from pdserve.engine.canary import MAX_QUEUED
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams, Sequence
from tests.helpers import THREADS, TINY_VOCAB, make_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("canary") / "tiny")


def engine(model_dir: Path, rate: float = 1.0, deterministic: bool = True) -> LLMEngine:
    config = EngineConfig(
        dtype="float32",
        num_threads=THREADS,
        cache=CacheConfig(num_blocks=256),
        deterministic=deterministic,
        canary_rate=rate,
    )
    threads = torch.get_num_threads()
    try:
        return LLMEngine(config, model_dir)
    finally:
        torch.set_num_threads(threads)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(8, 40))] for _ in range(n)]


def run_checks(e: LLMEngine) -> list[str]:
    """Step the idle engine until no check is queued or running; the ids of what it output."""
    seen = []
    for _ in range(10_000):
        if not e.has_compute():
            return seen
        seen += [o.request_id for o in e.step()]
    raise AssertionError("the canary never finished")


def test_a_perturbed_decode_step_is_reported_for_exactly_that_request(
    tiny: Path, caplog: pytest.LogCaptureFixture
) -> None:
    e = engine(tiny)
    victim: dict[str, str] = {}

    def fault(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        # The third output token of the fourth request: another token made unbeatable.
        logits = logits.clone()
        for row, seq in enumerate(seqs):
            if seq.request_id == victim.get("id") and len(seq.output_token_ids) == 2:
                logits[row, (int(logits[row].argmax()) + 1) % logits.shape[1]] += 1e4
        return logits

    e.testing_logits_fault = fault
    batch = prompts(8)
    ids = [f"user-{i}" for i in range(8)]
    victim["id"] = ids[3]
    for rid, p in zip(ids, batch, strict=True):
        e.add_request(rid, p, GREEDY)
    served = {}
    while e.requests:
        for o in e.step():
            assert o.request_id in ids  # a check's output never reaches anyone
            served[o.request_id] = o
    e.testing_logits_fault = None  # the recomputation runs the model as it is
    with caplog.at_level(logging.ERROR, logger="pdserve.engine.canary"):
        assert run_checks(e) == []
    assert e.snapshot().canary_checks == {"match": 7, "mismatch": 1}
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "user-3" in errors[0] and "token 2" in errors[0]


def test_no_fault_no_mismatch_over_200_requests(tiny: Path) -> None:
    e = engine(tiny)
    batch = prompts(200, seed=1)
    seeded = SamplingParams(max_tokens=6, temperature=0.9, seed=5, logprobs=True)
    for i in range(0, 200, 20):  # in waves, the checks running between them
        chunk = batch[i : i + 20]
        e.generate(chunk, [GREEDY if j % 2 else seeded for j in range(len(chunk))])
        run_checks(e)
    results = e.snapshot().canary_checks or {}
    assert (
        results.get("mismatch", 0) == 0
        and results.get("match", 0) + results.get("skipped", 0) == 200
    )
    assert results.get("match", 0) >= 100  # most were checked, not skipped


def test_a_check_gives_way_to_a_user_request(tiny: Path) -> None:
    e = engine(tiny)
    e.generate(prompts(1, seed=2), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    e.step()  # the check starts (and computes a step)
    assert e.canary is not None and e.canary.running is not None
    e.add_request("user", prompts(1, seed=3)[0], GREEDY)
    e.step()
    assert e.canary.running is None
    assert [s.request_id for s in e.scheduler.running] == ["user"]
    assert e.snapshot().canary_checks == {"yielded": 1}


def test_unsampled_and_unseeded_requests_are_not_checked_and_the_queue_is_bounded(
    tiny: Path,
) -> None:
    e = engine(tiny)
    e.generate(prompts(4), SamplingParams(max_tokens=4, temperature=1.0))  # unseeded: skipped
    assert e.canary is not None and not e.canary.ready(False)
    e.generate(prompts(MAX_QUEUED + 5, seed=4), GREEDY)  # the engine never idle in between
    assert e.snapshot().canary_checks == {"skipped": 5}
    run_checks(e)
    assert (e.snapshot().canary_checks or {}).get("match") == MAX_QUEUED
    assert not e.canary.ready(False) and not e.requests


def test_a_rate_outside_0_to_1_is_refused() -> None:
    with pytest.raises(ConfigError, match="--canary-rate"):
        EngineConfig(canary_rate=1.5)
