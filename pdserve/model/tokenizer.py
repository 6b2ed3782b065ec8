"""Tokenizer and chat template of a model directory (Hugging Face tokenizer files).

Chat content is text: a special-token string inside a message (`<|im_end|>`) is encoded as the
characters it is made of, never as the control token, unless the caller trusts the content.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

# Private-use characters that mark where a message's content goes in the rendered template.
_MARK = "\ue000{}\ue001"
_MARKS = re.compile("(\ue000\\d+\ue001)")


# The class transformers instantiates for a plain tokenizer.json (what GGUF conversion and
# many checkpoints name): loaded directly, it skips AutoTokenizer's loading of the model's
# config, whose import chain costs ~1.3 s of every node's start.
_PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _load(model_dir: Path) -> Any:
    config = model_dir / "tokenizer_config.json"
    named = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if named in _PLAIN_CLASSES and (model_dir / "tokenizer.json").is_file():
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class Tokenizer:
    def __init__(self, model_dir: str | Path, eos_token_ids: tuple[int, ...] = ()) -> None:
        self._tok = _load(Path(model_dir))
        eos = set(eos_token_ids)
        if self._tok.eos_token_id is not None:
            eos.add(int(self._tok.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size = len(self._tok)
        self.special_strings = tuple(
            t.content for t in self._tok.added_tokens_decoder.values() if t.special
        )
        # No token spans more characters than this: a text longer than `max_tokens` times it
        # is too long for `max_tokens`, known before tokenizing it.
        self.max_token_chars = max(len(t) for t in self._tok.get_vocab()) or 1

    @property
    def hf(self) -> Any:
        """The transformers tokenizer (for libraries that read its vocabulary)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def _render(self, messages: list[dict[str, Any]]) -> str:
        if not self._tok.chat_template:
            raise ValueError("this model has no chat template; use the completions API")
        return str(
            self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )

    def _has_special(self, content: Any) -> bool:
        return isinstance(content, str) and any(s in content for s in self.special_strings)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], trust_special_tokens: bool = False
    ) -> list[int]:
        """Token ids of the conversation followed by the assistant's generation prompt. Unless
        `trust_special_tokens`, special-token strings in message content are plain text: the
        template is rendered with a mark where each such content goes, the template's text is
        encoded with its control tokens, and each content without them."""
        tainted = [self._has_special(m.get("content")) for m in messages]
        if trust_special_tokens or not any(tainted):
            return list(self._tok.encode(self._render(messages), add_special_tokens=False))
        contents: dict[str, str] = {}
        marked = []
        for i, (m, bad) in enumerate(zip(messages, tainted, strict=True)):
            if bad:
                mark = _MARK.format(i)
                contents[mark] = m["content"]
                m = {**m, "content": mark}
            marked.append(m)
        ids: list[int] = []
        for piece in _MARKS.split(self._render(marked)):
            if piece in contents:
                ids += self._tok.encode(
                    contents[piece], add_special_tokens=False, split_special_tokens=True
                )
            elif piece:
                ids += self._tok.encode(piece, add_special_tokens=False)
        return ids
