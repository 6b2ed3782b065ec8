"""Engine behaviour on a tiny random Llama: abort anywhere, sampling, validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine, RequestError
from pdserve.engine.sequence import SamplingError, SamplingParams
from tests.helpers import assert_all_free, make_engine, make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def engine(tiny_dir: Path) -> LLMEngine:
    return make_engine(tiny_dir, num_blocks=48, max_batched_tokens=32)


def prompt(n: int, start: int = 3) -> list[int]:
    return [start + (i * 7) % 250 for i in range(n)]


def test_abort_mid_prefill_and_mid_decode_frees_every_block(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request("long", prompt(100), params)  # 100 tokens, 32 per step: 4 steps
    engine.add_request("short", prompt(10, 50), params)
    engine.step()
    assert engine.requests["long"].num_computed_tokens < 100  # mid-prefill
    aborted = engine.abort("long")
    assert aborted is not None and aborted.finish_reason == "abort" and aborted.finished
    for _ in range(5):
        engine.step()
    assert len(engine.requests["short"].output_token_ids) >= 3  # mid-decode
    engine.add_request("waiting", prompt(20, 90), params)
    assert engine.abort("short") is not None
    assert engine.abort("waiting") is not None
    assert engine.abort("unknown") is None
    assert_all_free(engine)


def test_generate_runs_to_completion_and_frees(engine: LLMEngine) -> None:
    outs = engine.generate([prompt(40), prompt(3)], SamplingParams(max_tokens=7, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [7, 7]
    assert all(o.finish_reason == "length" for o in outs)
    assert_all_free(engine)


def test_same_seed_same_tokens_different_seed_different(engine: LLMEngine) -> None:
    def run(seed: int) -> list[int]:
        p = SamplingParams(max_tokens=20, temperature=1.0, seed=seed, ignore_eos=True)
        return engine.generate([prompt(12)], p)[0].token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_seeded_request_is_independent_of_batch(engine: LLMEngine) -> None:
    p = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    alone = engine.generate([prompt(9)], p)[0].token_ids
    noisy = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    together = engine.generate([prompt(30, 40), prompt(9)], [noisy, p])[1].token_ids
    assert together == alone


def test_top_k_1_and_tiny_top_p_equal_greedy(engine: LLMEngine) -> None:
    greedy = engine.generate([prompt(15)], SamplingParams(max_tokens=10, temperature=0.0))
    k1 = engine.generate([prompt(15)], SamplingParams(max_tokens=10, temperature=1.5, top_k=1))
    p0 = engine.generate([prompt(15)], SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6))
    assert greedy[0].token_ids == k1[0].token_ids == p0[0].token_ids


def test_logprob_of_chosen_token_matches_transformers(engine: LLMEngine, tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = prompt(21)
    out = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, logprobs=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], -1)
    assert out.token_ids == [int(ref.argmax())]
    assert abs(out.logprobs[0] - float(ref.max())) < 1e-4


def test_stop_token_ids_and_max_tokens(engine: LLMEngine) -> None:
    free_run = engine.generate([prompt(8)], SamplingParams(max_tokens=10, temperature=0.0))[0]
    stop_at = free_run.token_ids[3]
    first = free_run.token_ids.index(stop_at)
    p = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop_at,))
    out = engine.generate([prompt(8)], p)[0]
    assert out.token_ids == free_run.token_ids[: first + 1] and out.finish_reason == "stop"


def test_invalid_requests_are_refused_with_reasons(engine: LLMEngine) -> None:
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(RequestError, match="context"):
        engine.add_request("l", prompt(2000), SamplingParams())
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request("v", [10**6], SamplingParams())
    with pytest.raises(RequestError, match="KV blocks"):
        engine.add_request("b", prompt(900), SamplingParams(max_tokens=100))
    with pytest.raises(SamplingError, match="top_p"):
        SamplingParams(top_p=0)
    engine.add_request("dup", prompt(4), SamplingParams())
    with pytest.raises(RequestError, match="already exists"):
        engine.add_request("dup", prompt(4), SamplingParams())
    engine.abort("dup")
    assert_all_free(engine)


def test_choices_after_a_parent_share_its_prompt_blocks_and_do_not_block_others(
    engine: LLMEngine,
) -> None:
    from pdserve.engine.outputs import RequestOutput
    from pdserve.engine.sequence import RequestOptions

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = [3 + (i * 11 + 5) % 250 for i in range(70)]  # 3 steps of 32 prompt tokens
    engine.add_request("p", ids, params)
    for i in (1, 2):
        engine.add_request(f"c{i}", ids, params, RequestOptions(after="p"))
    engine.add_request("other", prompt(5, 99), params)
    while engine.requests["other"].num_computed_tokens == 0:
        engine.step()
    # "other" came after the waiting choices and went ahead of them: they wait for the
    # parent's prompt, which was computed in chunks meanwhile.
    assert engine.requests["c1"].num_computed_tokens == 0
    outs: dict[str, RequestOutput] = {}
    while engine.requests:
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    shared = (len(ids) - 1) // 16 * 16  # whole blocks; the last token is always computed
    assert outs["p"].num_cached_tokens == 0
    for name in ("c1", "c2"):
        assert outs[name].num_cached_tokens == shared
        assert outs[name].token_ids == outs["p"].token_ids  # greedy, same prompt
    assert_all_free(engine)


def test_a_request_whose_sampling_fails_fails_alone(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pdserve.engine.sampler as module  # sample_batch samples through it

    real = module.sample

    def failing_for_seed_666(logits, rows):  # type: ignore[no-untyped-def]
        if any(r.params.seed == 666 for r in rows):
            raise RuntimeError("injected")
        return real(logits, rows)

    good = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    alone = engine.generate([prompt(10)], good)[0].token_ids
    monkeypatch.setattr(module, "sample", failing_for_seed_666)
    bad = SamplingParams(max_tokens=5, temperature=0.5, seed=666, ignore_eos=True)
    outs = engine.generate([prompt(10), prompt(12, 40)], [good, bad])
    assert outs[0].finish_reason == "length" and outs[0].token_ids == alone
    assert outs[1].finish_reason == "error" and "sampling failed" in str(outs[1].error)
    assert_all_free(engine)
