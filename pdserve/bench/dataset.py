"""Benchmark prompts: random token-id prompts with lengths drawn around --input-len and
--output-len (uniform within +/- range ratio), or a JSONL file of {"prompt", "output_len"}."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchPrompt:
    prompt: str | list[int]
    prompt_len: int  # as the generator knows it (token ids: exact; text: words, approximate)
    output_len: int


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(low, high)


def random_prompts(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    vocab: tuple[int, int] = (1000, 30000),
) -> list[BenchPrompt]:
    """Token-id prompts (every OpenAI-compatible server accepts `prompt` as a list of ids)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = _length(rng, input_len, range_ratio)
        ids = [rng.randrange(*vocab) for _ in range(length)]
        out.append(BenchPrompt(ids, length, _length(rng, output_len, range_ratio)))
    return out


def jsonl_prompts(path: str | Path, n: int, seed: int) -> list[BenchPrompt]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no prompts")
    rng = random.Random(seed)
    picked = [rows[rng.randrange(len(rows))] for _ in range(n)]
    return [
        BenchPrompt(r["prompt"], len(str(r["prompt"]).split()), int(r.get("output_len", 128)))
        for r in picked
    ]
