"""`pdserve generate`: prompts run to completion on a local engine, no server."""

from __future__ import annotations

import time
from pathlib import Path

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams


def generate_offline(
    config: EngineConfig,
    model_dir: Path,
    prompts: list[str],
    params: SamplingParams,
    chat: bool,
) -> int:
    engine = LLMEngine(config, model_dir)
    try:
        inputs: list[str | list[int]] = [
            engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) if chat else p
            for p in prompts
        ]
        start = time.perf_counter()
        outputs = engine.generate(inputs, params)
        elapsed = time.perf_counter() - start
    finally:
        engine.close()
    tokens = sum(len(o.token_ids) for o in outputs)
    for prompt, o in zip(prompts, outputs, strict=True):
        print(f"--- {prompt}\n{o.text}")
    print(f"[{tokens} tokens in {elapsed:.2f}s: {tokens / elapsed:.1f} tokens/s]")
    return 0
