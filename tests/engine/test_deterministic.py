"""--deterministic: a request's tokens and logprobs (its top 5 alternatives too) are the same
bits alone and in a batch of 8 or 16 other prompts, with its prompt prefilled whole or in
chunks, preempted and recomputed or not, its prefix found in the cache or computed, in bf16 and
float32, on SmolLM2 and on a tiny random Llama. Everything is compared with `==`. Without the
flag, the same comparison in bf16 finds a difference (the test can fail). The disaggregated
pair is in tests/disagg/test_deterministic_disagg.py."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import SamplingParams
from tests.helpers import THREADS, TINY_VOCAB, make_tiny_model

pytestmark = pytest.mark.slow

TOKENS = 12
GREEDY = SamplingParams(
    max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5
)
SEEDED = dataclasses.replace(GREEDY, temperature=0.8, top_p=0.95, seed=1234)


def prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(20, 90))] for _ in range(n)]


def result(out: RequestOutput) -> tuple[object, ...]:
    return (tuple(out.token_ids), tuple(out.logprobs), tuple(out.top_logprobs))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("det") / "tiny")


@pytest.fixture(
    scope="module",
    params=[
        ("tiny", "float32"),
        ("tiny", "bfloat16"),
        ("smollm", "float32"),
        ("smollm", "bfloat16"),
    ],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def case(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[tuple[Path, str, int]]:
    name, dtype = request.param
    if name == "tiny":
        yield tiny_dir, dtype, TINY_VOCAB
    else:
        fixture = "smollm_bf16_dir" if dtype == "bfloat16" else "smollm_fp32_dir"
        yield request.getfixturevalue(fixture), dtype, 49152


def engine(
    model_dir: Path,
    dtype: str,
    deterministic: bool = True,
    num_blocks: int = 512,
    batched_tokens: int = 2048,
    prefix_caching: bool = True,
) -> LLMEngine:
    config = EngineConfig(
        dtype=dtype,
        num_threads=THREADS,
        cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=batched_tokens),
        deterministic=deterministic,
    )
    threads = torch.get_num_threads()
    try:
        return LLMEngine(config, model_dir)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_alone_equals_in_batches_of_8_and_16(
    case: tuple[Path, str, int], params: SamplingParams
) -> None:
    model_dir, dtype, vocab = case
    e = engine(model_dir, dtype, prefix_caching=False)
    target, *others = prompts(vocab, 16, seed=7)
    alone = result(e.generate([target], params)[0])
    in_8 = e.generate([*others[:7], target], params)
    in_16 = e.generate([*others[:9], target, *others[9:]], params)
    assert result(in_8[7]) == alone
    assert result(in_16[9]) == alone
    # and every other prompt of the 16 as it came out of the 8
    for i in range(7):
        assert result(in_16[i]) == result(in_8[i])


def test_chunked_prefill_equals_whole(case: tuple[Path, str, int]) -> None:
    model_dir, dtype, vocab = case
    batch = prompts(vocab, 4, seed=11)
    whole = engine(model_dir, dtype, prefix_caching=False).generate(batch, GREEDY)
    chunked_engine = engine(model_dir, dtype, batched_tokens=32, prefix_caching=False)
    chunked = chunked_engine.generate(batch, GREEDY)
    assert max(len(p) for p in batch) > 32  # some prompt really came in chunks
    assert [result(o) for o in chunked] == [result(o) for o in whole]


def test_preempted_and_resumed_equals_undisturbed(case: tuple[Path, str, int]) -> None:
    model_dir, dtype, vocab = case
    batch = prompts(vocab, 8, seed=13)
    params = dataclasses.replace(GREEDY, max_tokens=48)  # three more blocks each
    undisturbed = engine(model_dir, dtype, prefix_caching=False).generate(batch, params)
    # Too few blocks for all eight as they grow: some are preempted and recomputed.
    pressed = engine(model_dir, dtype, num_blocks=16, prefix_caching=False)
    outs = pressed.generate(batch, params)
    assert pressed.scheduler.stats.num_preemptions > 0
    assert [result(o) for o in outs] == [result(o) for o in undisturbed]


def test_a_prefix_cache_hit_equals_a_miss(case: tuple[Path, str, int]) -> None:
    model_dir, dtype, vocab = case
    base = prompts(vocab, 1, seed=17)[0]
    longer = base + prompts(vocab, 1, seed=19)[0]
    e = engine(model_dir, dtype)
    first = e.generate([longer], GREEDY)[0]  # nothing cached
    e.generate([base], GREEDY)
    again = e.generate([longer], GREEDY)[0]  # its first blocks from the cache
    assert again.num_cached_tokens >= 16
    assert result(again) == result(first)
    no_cache = engine(model_dir, dtype, prefix_caching=False).generate([longer], GREEDY)[0]
    assert result(no_cache) == result(first)


def test_without_the_flag_batching_changes_bf16_output(smollm_bf16_dir: Path) -> None:
    """The proof that the comparison above can fail: the default mode multiplies a lone row
    through one kernel and a batch's through another, and some logprob moves."""
    e = engine(smollm_bf16_dir, "bfloat16", deterministic=False, prefix_caching=False)
    batch = prompts(49152, 16, seed=7)
    together = e.generate(batch, GREEDY)
    alone = [e.generate([p], GREEDY)[0] for p in batch[:4]]
    assert any(result(a) != result(t) for a, t in zip(alone, together, strict=False))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"quantization": "int8", "dtype": "bfloat16"}, "--quantization"),
        ({"tensor_parallel_size": 3}, "--tensor-parallel-size"),
        ({"attention_backend": "torch"}, "--attention-backend"),
    ],
)
def test_what_deterministic_does_not_take_is_refused(
    change: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(deterministic=True, **change)  # type: ignore[arg-type]
