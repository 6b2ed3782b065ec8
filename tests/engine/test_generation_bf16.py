"""bf16 generation on the bundled SmolLM2 with every fast path on (the compiled bf16 linears, the
decode step's layers in one compiled call, the paged decode and prefill kernels): against
transformers' bf16 model, and batched/preempted/chunked runs against each request run alone.

In bf16 these runs are not token-identical, and the tests do not ask it: every matmul rounds an
fp32 sum to 8 bits of mantissa, the order of that sum follows the kernel, and pdserve picks the
kernel by the number of rows in the step (torch's gemv for one row, the compiled kernel for 2-11,
fp32 GEMM from 12), so a row's rounding differs between a batch and alone, and between pdserve
and transformers. The criterion is vLLM's for its bf16 model tests: two greedy runs agree token
for token up to their first difference, and there each side's token is among the other's five
most likely. A wrong kernel, cache slot, position or mask breaks that within a token or two;
rounding moves a choice only where the top two are near a tie. Against transformers every token
is also checked teacher-forced (after the runs part too). The fp32 runs of `test_generation.py`
hold to exact identity.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from tests.engine.test_generation import (
    BATCH_SETTINGS,
    MIXED_OUT,
    PROMPTS,
    assert_setting_exercised,
    mixed_prompts,
)
from tests.helpers import assert_all_free, make_engine

pytestmark = pytest.mark.slow

TOP = 5
GREEDY_OUT = 24


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=TOP
    )


Run = tuple[list[int], list[set[int]]]  # greedy tokens, the TOP most likely ids at each


def agree_up_to_near_tie(ours: Run, ref: Run, what: str) -> int:
    """The position of the first difference (or the length): before it the tokens are equal, at
    it each side's token is among the other's TOP most likely. The callers also ask that most
    tokens are compared at all, so that a difference at the first token of every run (where
    nothing after it is checked) cannot pass."""
    (a, a_top), (b, b_top) = ours, ref
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            assert x in b_top[i] and y in a_top[i], (
                f"{what}: token {i} is {x} here and {y} in the reference, and one is not among "
                f"the other's {TOP} most likely: {sorted(a_top[i])} vs {sorted(b_top[i])}"
            )
            return i
    return len(a)


def run(engine: LLMEngine, prompts: list, max_tokens: int) -> list[Run]:
    outs = engine.generate(prompts, params(max_tokens))
    return [(o.token_ids, [{t for t, _ in top} for top in o.top_logprobs]) for o in outs]


@pytest.fixture(scope="module")
def engine(smollm_bf16_dir: Path) -> LLMEngine:
    engine = make_engine(smollm_bf16_dir, dtype="bfloat16", num_blocks=1024)
    # the fast paths this module is about are the ones in use
    assert engine.model.fused_decode is not None, "the fused decode step is not in use"
    return engine


@pytest.fixture(scope="module")
def hf_bf16(hf_smollm):  # type: ignore[no-untyped-def]
    return copy.deepcopy(hf_smollm).to(torch.bfloat16)  # the fixture stays fp32


def hf_greedy(hf, prompt: list[int], max_tokens: int) -> Run:  # type: ignore[no-untyped-def]
    """transformers' forward, greedy, through its KV cache (no generation config: no EOS, no
    logits processors)."""
    ids, past, run = torch.tensor([prompt]), None, ([], [])  # type: ignore[var-annotated]
    with torch.no_grad():
        for _ in range(max_tokens):
            # the cache: the fourth argument, named past_key_values before transformers 5
            out = hf(ids, None, None, past, use_cache=True)
            past = out["cache"] if "cache" in out else out["past_key_values"]
            logits = out.logits[0, -1].float()
            run[0].append(int(logits.argmax()))
            run[1].append(set(logits.topk(TOP).indices.tolist()))
            ids = torch.tensor([[run[0][-1]]])
    return run


def hf_top_along(hf, prompt: list[int], tokens: list[int]) -> list[set[int]]:  # type: ignore[no-untyped-def]
    """transformers' TOP most likely ids at each of `tokens`' positions, given the prompt and the
    tokens before it: one teacher-forced forward over both."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :].float()
    return [set(row.topk(TOP).indices.tolist()) for row in logits]


def test_greedy_follows_transformers_bf16(engine: LLMEngine, hf_bf16) -> None:  # type: ignore[no-untyped-def]
    """Each run agrees with transformers' own greedy run up to a near tie, and every token it
    chose, after that point too, is among the TOP transformers ranks highest given the run's own
    tokens before it. Where two runs part is a matter of rounding (bf16 logits of ~15 are 0.0625
    apart: on this suite's prompts some paths part at a prompt's first token, where transformers'
    fp32 top two are 0.11 apart), so the tokens after it are checked against transformers' forward
    of the run itself rather than counted (on a Zen 5, teacher-forced, every token of every path
    was transformers' first or second choice, at most 0.25 below its best)."""
    ours = run(engine, PROMPTS, GREEDY_OUT)
    for prompt, mine in zip(PROMPTS, ours, strict=True):
        ids = engine.tokenizer.encode(prompt)
        agree_up_to_near_tie(mine, hf_greedy(hf_bf16, ids, GREEDY_OUT), prompt)
        tokens = mine[0]
        off = [
            (i, t, sorted(top))
            for i, (t, top) in enumerate(
                zip(tokens, hf_top_along(hf_bf16, ids, tokens), strict=True)
            )
            if t not in top
        ]
        assert not off, f"{prompt!r}: tokens outside transformers' {TOP} most likely: {off}"
    assert_all_free(engine)


@pytest.fixture(scope="module")
def alone(engine: LLMEngine) -> list[Run]:
    return [run(engine, [p], MIXED_OUT)[0] for p in mixed_prompts(engine)]


@BATCH_SETTINGS
def test_batch_follows_alone_bf16(
    smollm_bf16_dir: Path, engine: LLMEngine, alone: list[Run], setting: dict
) -> None:
    batched = make_engine(smollm_bf16_dir, dtype="bfloat16", **setting)
    outs = run(batched, mixed_prompts(engine), MIXED_OUT)
    compared = sum(
        agree_up_to_near_tie(o, a, f"request {i}")
        for i, (o, a) in enumerate(zip(outs, alone, strict=True))
    )
    assert compared >= len(alone) * MIXED_OUT // 2, f"only {compared} tokens before differences"
    assert_setting_exercised(batched, setting)
