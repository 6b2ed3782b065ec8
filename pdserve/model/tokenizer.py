"""Tokenizer and chat template of a model directory (Hugging Face tokenizer files).

Chat content is text: a special-token string inside a message (`<|im_end|>`) is encoded as the
characters it is made of, never as the control token, unless the caller trusts the content.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
from collections.abc import Iterable
from importlib.metadata import version
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Private-use characters that mark where a message's content goes in the rendered template.
_MARK = "\ue000{}\ue001"
_MARKS = re.compile("(\ue000\\d+\ue001)")


# The class transformers instantiates for a plain tokenizer.json (what GGUF conversion and
# many checkpoints name): loaded directly, it skips AutoTokenizer's loading of the model's
# config, whose import chain costs ~1.3 s of every node's start.
_PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# The files transformers builds a tokenizer from: a compiled tokenizer is keyed by their bytes
# (and by transformers' version, which decides what it builds from them).
_SOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "added_tokens.json", "chat_template.jinja")  # fmt: skip
_COMPILED_FORMAT = 1


def _is_plain(model_dir: Path) -> bool:
    config = model_dir / "tokenizer_config.json"
    named = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    return named in _PLAIN_CLASSES and (model_dir / "tokenizer.json").is_file()


def _load(model_dir: Path) -> Any:
    if _is_plain(model_dir):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _digest_files(model_dir: Path, digest: Any) -> Any:
    for name in _SOURCE_FILES:
        if (model_dir / name).is_file():
            digest.update(b"\0" + name.encode() + b"\0" + (model_dir / name).read_bytes())
    return digest


def tokenizer_digest(model_dir: Path) -> str:
    """A hash of the files a model's tokenizer is built from (and its chat template): two
    nodes whose digests differ may turn the same text into different tokens."""
    return str(_digest_files(model_dir, hashlib.sha256()).hexdigest()[:32])


def _compiled_path(model_dir: Path, cache_dir: Path) -> Path:
    digest = hashlib.sha256(f"{_COMPILED_FORMAT} {version('transformers')}".encode())
    _digest_files(model_dir, digest)
    return cache_dir / "tokenizers" / f"{digest.hexdigest()[:32]}.json"


def _compile(hf: Any) -> dict[str, Any] | None:
    """What encoding and decoding need from a plain tokenizer transformers built: its Rust
    tokenizer as transformers configured it (post-processor, pre-tokenizer and added tokens
    rewritten at load) and its eos id. None where transformers' decode does more than the Rust
    tokenizer's (a clean-up of spaces it applies), so that only transformers is equivalent."""
    if type(hf).__name__ not in _PLAIN_CLASSES or hf.split_special_tokens:
        return None
    bpe = type(hf.backend_tokenizer.model).__name__ == "BPE"
    force = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    if hf.clean_up_tokenization_spaces and (not bpe or getattr(hf, force, False)):
        return None
    return {"tokenizer": hf.backend_tokenizer.to_str(), "eos_token_id": hf.eos_token_id}


def _store(path: Path, compiled: dict[str, Any]) -> None:
    """Written whole or not at all: a temporary file renamed into place."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as f:
            json.dump(compiled, f)
        os.replace(f.name, path)
    except OSError as e:  # a read-only cache costs the next start its speed, nothing else
        logger.warning("could not store the compiled tokenizer in %s: %s", path.parent, e)


class Tokenizer:
    """Encoding and decoding run on the Rust tokenizer that transformers builds for a plain
    tokenizer; with a `cache_dir` it is stored there once and later starts load it without
    importing transformers (~0.9 s of a node's start). Chat templates and the vocabulary
    libraries read come from transformers' tokenizer, loaded on first use."""

    def __init__(
        self,
        model_dir: str | Path,
        eos_token_ids: tuple[int, ...] = (),
        cache_dir: str | Path | None = None,
    ) -> None:
        self._dir = Path(model_dir)
        self._hf: Any = None
        self._hf_lock = threading.Lock()
        compiled = None
        path = _compiled_path(self._dir, Path(cache_dir)) if cache_dir else None
        if path is not None and path.is_file():
            try:
                compiled = json.loads(path.read_text())
            except (OSError, ValueError) as e:  # built again and stored anew below
                logger.warning("ignoring the unreadable compiled tokenizer %s: %s", path, e)
        if compiled is None:
            compiled = _compile(self.hf)
            if compiled is not None and path is not None:
                _store(path, compiled)
        self._codec: _Codec = _HFCodec(self.hf) if compiled is None else _RustCodec(compiled)
        eos = set(eos_token_ids)
        if self._codec.eos_token_id is not None:
            eos.add(int(self._codec.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size = self._codec.vocab_size
        self.special_strings = self._codec.special_strings
        # No token spans more characters than this: a text longer than `max_tokens` times it
        # is too long for `max_tokens`, known before tokenizing it.
        self.max_token_chars = max(len(t) for t in self._codec.vocab) or 1

    @property
    def hf(self) -> Any:
        """The transformers tokenizer (chat templates; libraries that read its vocabulary),
        loaded on first use."""
        with self._hf_lock:
            if self._hf is None:
                self._hf = _load(self._dir)
            return self._hf

    def load_chat_template(self) -> None:
        """Loads what rendering a chat takes (transformers' tokenizer) now, not on first use."""
        _ = self.hf

    def encode(self, text: str) -> list[int]:
        return self._codec.encode(text, add_special_tokens=True)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._codec.decode(token_ids, skip_special_tokens)

    def _render(self, messages: list[dict[str, Any]]) -> str:
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; use the completions API")
        return str(
            self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
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
            return self._codec.encode(self._render(messages), add_special_tokens=False)
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
                ids += self._codec.encode(contents[piece], add_special_tokens=False, split=True)
            elif piece:
                ids += self._codec.encode(piece, add_special_tokens=False)
        return ids


class _Codec:
    eos_token_id: int | None
    vocab_size: int
    special_strings: tuple[str, ...]
    vocab: Iterable[str]

    def encode(self, text: str, add_special_tokens: bool, split: bool = False) -> list[int]:
        """`split`: special-token strings in `text` are the characters they are made of."""
        raise NotImplementedError

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        raise NotImplementedError


class _RustCodec(_Codec):
    def __init__(self, compiled: dict[str, Any]) -> None:
        self._source = compiled["tokenizer"]
        self._tok = self._build(split=False)
        self.eos_token_id = compiled["eos_token_id"]
        # The splitting encoder is a second instance, built on first use, rather than one
        # whose flag is switched per call: encodes may run on several threads at once.
        self._split: Any = None
        self._split_lock = threading.Lock()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder().values()
        self.special_strings = tuple(t.content for t in added if t.special)
        self.vocab = self._tok.get_vocab(with_added_tokens=True).keys()

    def _build(self, split: bool) -> Any:
        from tokenizers import Tokenizer as RustTokenizer

        tok = RustTokenizer.from_str(self._source)
        tok.no_truncation()  # as transformers encodes without a max_length
        tok.no_padding()
        tok.encode_special_tokens = split
        return tok

    def encode(self, text: str, add_special_tokens: bool, split: bool = False) -> list[int]:
        tok = self._tok
        if split:
            with self._split_lock:
                if self._split is None:
                    self._split = self._build(split=True)
            tok = self._split
        return list(tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))


class _HFCodec(_Codec):
    """A tokenizer only transformers reproduces (a Python tokenizer, a clean-up on decode)."""

    def __init__(self, hf: Any) -> None:
        self._tok = hf
        self.eos_token_id = hf.eos_token_id
        self.vocab_size = len(hf)
        self.special_strings = tuple(
            t.content for t in hf.added_tokens_decoder.values() if t.special
        )
        self.vocab = hf.get_vocab().keys()

    def encode(self, text: str, add_special_tokens: bool, split: bool = False) -> list[int]:
        return list(
            self._tok.encode(
                text, add_special_tokens=add_special_tokens, split_special_tokens=split
            )
        )

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))
