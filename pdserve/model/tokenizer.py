"""Tokenizer and chat template of a model directory (Hugging Face tokenizer files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, model_dir: str | Path, eos_token_ids: tuple[int, ...] = ()) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(model_dir))
        eos = set(eos_token_ids)
        if self._tok.eos_token_id is not None:
            eos.add(int(self._tok.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the conversation followed by the assistant's generation prompt."""
        if not self._tok.chat_template:
            raise ValueError("this model has no chat template; use the completions API")
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self._tok.encode(text, add_special_tokens=False))
