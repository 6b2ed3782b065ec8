"""Weight-only int8/int4: the kernels compute with the weight the quantization defines (recovered
by multiplying with the identity and checked against a per-row / per-group rounding bound), and on
the real model the accuracy guards hold against bf16: greedy agreement on the first 32 tokens of
16 prompts, and perplexity on a fixed text."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pdserve.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from pdserve.model.linear import Linear, layer_quantization
from tests.helpers import THREADS, engine_logits

GROUP = 32  # int4 groups along the input, with a minimum (GGUF Q4_1's layout)


def recovered_weight(layer: Linear, k: int) -> torch.Tensor:
    """The weight a layer computes with: its output for the identity input, [N, K]."""
    with torch.inference_mode():
        return layer(torch.eye(k, dtype=torch.bfloat16)).float().T


def quantized_layer(weight: torch.Tensor, kind: str) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], bias=False).to(torch.bfloat16)
    layer.weight.data.copy_(weight)
    layer.pack(kind)
    return layer


@pytest.mark.parametrize("shape", [(64, 96), (48, 576), (7, 32)])
def test_int8_weight_is_the_row_scaled_rounding(shape: tuple[int, int]) -> None:
    n, k = shape
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.05).bfloat16()
    got = recovered_weight(quantized_layer(w, "int8"), k)
    step = w.float().abs().amax(dim=1, keepdim=True) / 127  # one step per row
    err = (got - w.float()).abs()
    # half a step of rounding, plus bf16 rounding of the scale and of the output
    assert (err <= step * 0.5 + w.float().abs() * 2**-7 + 1e-6).all()
    assert err.max() > 0  # it is quantized, not the bf16 weight passed through


@pytest.mark.parametrize("shape", [(64, 96), (48, 576)])
def test_int4_weight_is_the_group_min_scale_rounding(shape: tuple[int, int]) -> None:
    n, k = shape
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.05).bfloat16()
    got = recovered_weight(quantized_layer(w, "int4"), k)
    groups = w.float().reshape(n, k // GROUP, GROUP)
    step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
    err = (got.reshape(n, k // GROUP, GROUP) - groups).abs()
    assert (err <= step * 0.5 + groups.abs() * 2**-7 + step * 2**-6 + 1e-6).all()
    # 16 levels per group: most weights move, by up to half a step
    assert (err > 0).float().mean() > 0.5


def test_int4_keeps_shapes_the_kernel_cannot_take_unquantized() -> None:
    assert layer_quantization(torch.zeros(48, 576, dtype=torch.bfloat16), "int4") == "int4"
    assert layer_quantization(torch.zeros(7, 96, dtype=torch.bfloat16), "int4") == "none"
    assert layer_quantization(torch.zeros(48, 40, dtype=torch.bfloat16), "int4") == "none"
    assert layer_quantization(torch.zeros(7, 40, dtype=torch.bfloat16), "int8") == "int8"


def test_quantization_needs_bf16_activations() -> None:
    with pytest.raises(ConfigError, match="needs --dtype bfloat16"):
        EngineConfig(dtype="float32", quantization="int8")
    with pytest.raises(ConfigError, match="quantization must be one of"):
        EngineConfig(quantization="fp8")


# ---- accuracy guards on SmolLM2-135M (bf16 is the reference) -------------------------------

PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain photosynthesis to a child.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What does a compiler do?",
    "Describe a cat in two sentences.",
    "How many legs does a spider have?",
    "Suggest a name for a bakery.",
    "What is the boiling point of water?",
    "Summarize the plot of Cinderella.",
    "Write one sentence about autumn.",
    "What is 12 times 12?",
    "Name a famous painter and one of their works.",
]
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. From the lamp room "
    "he could see the fishing boats returning to the harbour, their lights scattered across the "
    "dark water like sparks. He wiped the great lens with a soft cloth, checked the oil, and "
    "wrote the weather in his log: wind from the west, a light swell, clouds gathering over the "
    "headland. When the storms came in winter, he stayed awake all night, listening to the waves "
    "breaking against the rocks below and watching for ships in trouble.\n\n"
    "A bread dough needs four things: flour, water, salt and yeast. Mix the flour and water "
    "first and let them rest for half an hour, so that the flour can absorb the water. Then add "
    "the salt and the yeast, and knead the dough until it is smooth and elastic. Cover the bowl "
    "and leave it in a warm place until the dough has doubled in size. Shape it into a loaf, let "
    "it rise again, and bake it in a hot oven until the crust is golden brown and the loaf "
    "sounds hollow when you tap it underneath.\n\n"
    "Rivers begin as small streams high in the mountains, fed by rain and melting snow. As they "
    "flow downhill they join together, growing wider and slower, carving valleys through the "
    "rock over thousands of years. Near the sea a river often splits into many channels and "
    "drops the sand and mud it has carried, building a delta of rich, flat land where farmers "
    "grow rice and vegetables. Many of the oldest cities in the world were built beside rivers, "
    "which gave people water to drink, fish to eat and a road for trade.\n\n"
    "To sort a list of numbers, a simple method is to compare each pair of neighbours and swap "
    "them when they are in the wrong order, repeating until no swaps are needed. This is easy "
    "to understand but slow for long lists. Faster methods divide the list into smaller parts, "
    "sort each part, and then merge the sorted parts together, which takes far fewer "
    "comparisons when the list is large."
)


def smollm(model_dir: Path, quantization: str) -> LLMEngine:
    config = EngineConfig(
        dtype="bfloat16",
        num_threads=THREADS,
        quantization=quantization,
        cache=CacheConfig(num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=16),
    )
    return LLMEngine(config, model_dir)


def chat_prompts(engine: LLMEngine) -> list[list[int]]:
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}])
            for p in PROMPTS]  # fmt: skip


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(list(prompts), params)]


def teacher_forced_greedy(
    engine: LLMEngine, prompts: list[list[int]], reference: list[list[int]]
) -> list[list[int]]:
    """The token this engine picks greedily at each of the reference's positions, given the
    reference's own prefix: one flip does not drag the rest of the continuation with it."""
    picks = []
    for prompt, ref in zip(prompts, reference, strict=True):
        ids = prompt + ref[:-1]
        logits = engine_logits(engine, ids, [len(ids)])
        picks.append(logits[len(prompt) - 1 :].argmax(dim=-1).tolist())
    return picks


def perplexity(engine: LLMEngine) -> float:
    ids = engine.tokenizer.encode(TEXT)
    logits = engine_logits(engine, ids, [len(ids)])[:-1]
    return math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item())


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for r, t in zip(a, b, strict=True) for x, y in zip(r, t, strict=True))
    return same / sum(len(r) for r in a)


@pytest.fixture(scope="module")
def bf16_reference(smollm_bf16_dir: Path) -> tuple[list[list[int]], list[list[int]], float]:
    engine = smollm(smollm_bf16_dir, "none")
    prompts = chat_prompts(engine)
    return prompts, greedy(engine, prompts), perplexity(engine)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_smollm_keeps_greedy_tokens_and_perplexity(
    smollm_bf16_dir: Path,
    bf16_reference: tuple[list[list[int]], list[list[int]], float],
    kind: str,
) -> None:
    """Greedy agreement is counted position by position with the reference's prefix fed in
    (teacher-forced): free-running, a single near-tie flip changes every later token, and on
    this model even fp32 agrees with bf16 on only ~81% of free-running tokens (measured)."""
    prompts, ref_tokens, ref_ppl = bf16_reference
    engine = smollm(smollm_bf16_dir, kind)
    assert sum(len(r) for r in ref_tokens) == 16 * 32
    forced = agreement(ref_tokens, teacher_forced_greedy(engine, prompts, ref_tokens))
    ppl = perplexity(engine)
    print(f"{kind}: agreement {forced:.3f}, ppl {ppl:.3f} vs {ref_ppl:.3f}")
    assert forced >= 0.90
    assert abs(ppl - ref_ppl) / ref_ppl <= 0.02
