"""Writes sharegpt_sample.jsonl: 64 ShareGPT-style prompts (questions and instructions of
varied length, each with the length of its reference answer) made from templates with a fixed
seed, so `pdserve bench serve --dataset` needs no download."""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = ["photosynthesis", "the French revolution", "black holes", "sourdough bread",
          "the stock market", "machine learning", "the Roman empire", "climate change",
          "jazz music", "the human heart", "volcanoes", "cryptography", "chess openings",
          "coral reefs", "the printing press", "quantum computing"]  # fmt: skip
ASKS = ["Explain {t} to a curious teenager.",
        "Write a short essay about {t}. Cover its history, how it works and why it matters.",
        "Give me five surprising facts about {t}.",
        "I am preparing a talk on {t}. Draft an outline with an introduction, three main "
        "points and a conclusion, and suggest one question the audience might ask.",
        "Summarize the main debates around {t} in a neutral tone.",
        "Write a poem about {t}."]  # fmt: skip
CONTEXT = (
    "Here is some background I collected earlier, please take it into account: "
    "{t} has been studied for a long time and people disagree about many details. "
)


def main() -> None:
    rng = random.Random(0)
    rows = []
    for _ in range(64):
        topic = rng.choice(TOPICS)
        prompt = rng.choice(ASKS).format(t=topic)
        if rng.random() < 0.4:
            prompt = CONTEXT.format(t=topic) * rng.randint(1, 12) + prompt
        rows.append({"prompt": prompt, "output_len": rng.choice([32, 64, 128, 256])})
    out = Path(__file__).with_name("sharegpt_sample.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
