"""Penalties, logit bias, min_tokens and top logprobs on a tiny random Llama, each against an
independent reference: transformers' `generate` with its own logits processors where it has
one, and transformers' forward with the OpenAI definition applied step by step where it has
none (presence/frequency penalties)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.failure import FailureReason
from pdserve.engine.llm_engine import LLMEngine, RequestError
from pdserve.engine.sequence import (
    MAX_GUIDE_CHARS,
    MAX_LOGIT_BIAS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    Guide,
    GuideKind,
    SamplingError,
    SamplingParams,
)
from tests.helpers import assert_all_free, make_engine, make_tiny_model

EOS = 2  # the tiny tokenizer's


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def hf(tiny_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


@pytest.fixture
def engine(tiny_dir: Path) -> LLMEngine:
    return make_engine(tiny_dir, num_blocks=64)


PROMPTS = [[3 + (i * 7 + k * 13) % 250 for i in range(n)] for k, n in enumerate((9, 23, 40))]


def hf_generate(hf: torch.nn.Module, ids: list[int], n: int, **kw: object) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=EOS,
            pad_token_id=0, **kw,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def greedy(engine: LLMEngine, n: int, **kw: object) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, **kw)  # type: ignore[arg-type]
    outs = engine.generate(PROMPTS, params)  # batched together: rows must not leak
    assert_all_free(engine)
    return [o.token_ids for o in outs]


def test_repetition_penalty_matches_transformers(engine: LLMEngine, hf: torch.nn.Module) -> None:
    plain = greedy(engine, 24)
    got = greedy(engine, 24, repetition_penalty=1.8)
    want = [hf_generate(hf, p, 24, repetition_penalty=1.8) for p in PROMPTS]
    assert got == want
    assert got != plain  # the penalty changed something, so the comparison means something


def test_logit_bias_and_min_tokens_match_transformers(
    engine: LLMEngine, hf: torch.nn.Module
) -> None:
    # EOS pushed up so that it would end every output early, but banned for 6 tokens.
    bias = {EOS: 9.0, 17: 4.0, 40: -3.0}
    got = greedy(engine, 20, logit_bias=tuple(bias.items()), min_tokens=6)
    want = [
        hf_generate(hf, p, 20, sequence_bias={(t,): b for t, b in bias.items()}, min_new_tokens=6)
        for p in PROMPTS
    ]
    assert got == want
    assert all(len(o) >= 6 and EOS not in o[:6] for o in got)
    early = greedy(engine, 20, logit_bias=tuple(bias.items()))
    assert any(len(o) < 6 for o in early)  # without min_tokens the bias ends them sooner


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(engine: LLMEngine) -> None:
    first = greedy(engine, 1)
    stop_id = first[0][0]  # the first prompt's first token: stops it at once unless held back
    got = greedy(engine, 8, stop_token_ids=(stop_id,), min_tokens=4)
    assert len(got[0]) >= 4 and stop_id not in got[0][:4]
    text = engine.tokenizer.decode([stop_id])
    params = SamplingParams(max_tokens=8, temperature=0.0, stop=(text,), min_tokens=3)
    out = engine.generate(PROMPTS[:1], params)[0]
    assert len(out.token_ids) >= 3


def _presence_frequency_reference(
    hf: torch.nn.Module, ids: list[int], n: int, presence: float, frequency: float
) -> list[int]:
    """OpenAI's definition: logit[j] -= count[j] * frequency + (count[j] > 0) * presence, over
    the tokens generated so far."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out])).logits[0, -1]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0])
        logits = logits - counts * frequency - (counts > 0).float() * presence
        token = int(logits.argmax())
        out.append(token)
        if token == EOS:
            break
    return out


def test_presence_and_frequency_penalties_follow_the_openai_definition(
    engine: LLMEngine, hf: torch.nn.Module
) -> None:
    got = greedy(engine, 20, presence_penalty=1.5, frequency_penalty=0.7)
    want = [_presence_frequency_reference(hf, p, 20, 1.5, 0.7) for p in PROMPTS]
    assert got == want
    assert got != greedy(engine, 20)
    negative = greedy(engine, 20, frequency_penalty=-2.0)  # rewards repeating
    want = [_presence_frequency_reference(hf, p, 20, 0.0, -2.0) for p in PROMPTS]
    assert negative == want


def test_top_logprobs_are_the_models_most_likely_tokens(
    engine: LLMEngine, hf: torch.nn.Module
) -> None:
    params = SamplingParams(
        max_tokens=6, temperature=0.8, seed=3, logprobs=True, top_logprobs=5,
        presence_penalty=0.5,  # adjusted sampling; the logprobs stay the model's own
    )  # fmt: skip
    outs = engine.generate(PROMPTS, params)
    for ids, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids + out.token_ids])).logits[0], -1)
        assert len(out.top_logprobs) == len(out.token_ids) == len(out.logprobs)
        for i, (token, lp, top) in enumerate(
            zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True)
        ):
            row = ref[len(ids) - 1 + i]
            assert abs(lp - float(row[token])) < 1e-4
            values, want_ids = torch.topk(row, 5)
            assert [t for t, _ in top] == want_ids.tolist()
            assert max(abs(a - b) for (_, a), b in zip(top, values.tolist(), strict=True)) < 1e-4


def test_out_of_range_controls_are_refused_by_name(engine: LLMEngine) -> None:
    bad = [
        dict(presence_penalty=2.5),
        dict(frequency_penalty=float("nan")),
        dict(repetition_penalty=0.0),
        dict(min_tokens=9, max_tokens=4),
        dict(top_logprobs=21, logprobs=True),
        dict(logit_bias=((5, 101.0),)),
    ]
    for kw in bad:
        name = next(k for k in kw if k != "max_tokens" and k != "logprobs")
        with pytest.raises(SamplingError, match=name):
            SamplingParams(**kw)  # type: ignore[arg-type]
    for field in ("logit_bias", "stop_token_ids"):
        value = ((300, 1.0),) if field == "logit_bias" else (300,)
        with pytest.raises(RequestError, match=f"{field} names token id 300"):
            engine.add_request("x", PROMPTS[0], SamplingParams(**{field: value}))  # type: ignore[arg-type]
    assert_all_free(engine)


def test_lists_and_numbers_beyond_their_caps_are_refused_naming_the_cap() -> None:
    """Each list is checked per token on the engine thread, for every stream of the node, and
    every number must fit the field that carries it to the other node: beyond the caps a
    request is refused, naming the field and the cap."""
    bad = {
        "stop": dict(stop=("a",) * (MAX_STOP + 1)),
        f"{MAX_STOP_CHARS} characters": dict(stop=("x" * (MAX_STOP_CHARS + 1),)),
        "stop_token_ids": dict(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1))),
        "logit_bias": dict(logit_bias=tuple((t, 1.0) for t in range(MAX_LOGIT_BIAS + 1))),
        "seed": dict(seed=2**63),
        "max_tokens": dict(max_tokens=2**31),
        "top_k": dict(top_k=2**31),
        "structured output": dict(guide=Guide(GuideKind.REGEX, "a" * (MAX_GUIDE_CHARS + 1))),
    }
    for name, kw in bad.items():
        with pytest.raises(SamplingError, match=name):
            SamplingParams(**kw)  # type: ignore[arg-type]
    # At the caps: accepted.
    SamplingParams(
        stop=("x" * MAX_STOP_CHARS,) * MAX_STOP,
        stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS)),
        logit_bias=tuple((t, 1.0) for t in range(MAX_LOGIT_BIAS)),
        seed=2**63 - 1,
        max_tokens=2**31 - 1,
    )


def test_a_reused_request_id_is_refused_while_its_blocks_are_held(engine: LLMEngine) -> None:
    """A prefill node keeps a finished request's blocks until their send completes (the
    connector's `hold_blocks`): a second request with that id must not replace the first in
    the held map (its blocks would never return)."""
    engine.scheduler.hold_blocks = lambda seq: True  # what KVSender does until the send is out
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=1))
    while engine.scheduler.num_unfinished:
        engine.step()
    assert "r" in engine.scheduler.held
    with pytest.raises(RequestError) as refused:
        engine.add_request("r", PROMPTS[1], SamplingParams(max_tokens=1))
    assert refused.value.failure.reason == FailureReason.DUPLICATE
    engine.scheduler.hold_blocks = lambda seq: False
    engine.scheduler.release_held("r")
    assert_all_free(engine)
