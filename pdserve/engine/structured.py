"""Structured output: a request's `Guide` (a JSON schema, any JSON object, a regex, a choice of
strings or an EBNF grammar) compiled by xgrammar for the model's tokenizer into a matcher that
follows the output token by token; before each sampling the matcher's token bitmask masks the
request's logits row, so batching is unchanged. A remotely prefilled request's guide travels
with it: prefill samples the first token under its own matcher, decode's matcher accepts that
token and continues."""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from pdserve.engine.sequence import Guide, GuideKind

if TYPE_CHECKING:
    import xgrammar


CACHE_BYTES = 64 << 20


class GuideError(ValueError):
    """A guide that cannot be compiled; the message says what is wrong with it."""


def _choice_grammar(spec: str) -> str:
    choices = json.loads(spec)
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def compile_with(compiler: Any, guide: Guide) -> Any:
    """`guide` compiled by an xgrammar GrammarCompiler; GuideError when it cannot be."""
    try:
        if guide.kind == GuideKind.JSON_OBJECT:
            return compiler.compile_json_schema('{"type": "object"}')  # OpenAI's json_object
        if guide.kind == GuideKind.JSON_SCHEMA:
            return compiler.compile_json_schema(guide.spec)
        if guide.kind == GuideKind.REGEX:
            return compiler.compile_regex(guide.spec)
        if guide.kind == GuideKind.CHOICE:
            return compiler.compile_grammar(_choice_grammar(guide.spec))
        return compiler.compile_grammar(guide.spec)
    except Exception as e:  # xgrammar raises RuntimeError, ValueError or its own types
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        detail = detail.split(": ", 1)[-1] if "] /" in detail else detail
        raise GuideError(f"{guide.kind.value}: cannot be compiled: {detail}") from e


class Grammars:
    """Matchers for guides compiled for one tokenizer, and the logits mask. A node compiles
    guides in worker processes (`guide_worker.py`) and hands the results in (`add_compiled`);
    a guide nobody compiled before (an engine used on its own) is compiled here, by xgrammar
    with its own cache."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        # Compiled grammars are cached (a repeated schema compiles once), within a bound.
        self._compiler = xgr.GrammarCompiler(
            self.info, max_threads=1, cache_limit_bytes=CACHE_BYTES
        )
        self._compiled: collections.OrderedDict[Guide, Any] = collections.OrderedDict()
        self._compiled_bytes = 0
        self._lock = threading.Lock()
        self.vocab_size = vocab_size

    def has(self, guide: Guide) -> bool:
        with self._lock:
            return guide in self._compiled

    def add_compiled(self, guide: Guide, compiled_json: str) -> None:
        """A guide compiled elsewhere (its grammar's JSON), kept for the engine thread."""
        compiled = self._xgr.CompiledGrammar.deserialize_json(compiled_json, self.info)
        with self._lock:
            self._compiled[guide] = compiled
            self._compiled_bytes += compiled.memory_size_bytes
            while self._compiled_bytes > CACHE_BYTES and len(self._compiled) > 1:
                _, old = self._compiled.popitem(last=False)
                self._compiled_bytes -= old.memory_size_bytes

    def matcher(self, guide: Guide) -> xgrammar.GrammarMatcher:
        with self._lock:
            compiled = self._compiled.get(guide)
            if compiled is not None:
                self._compiled.move_to_end(guide)
        if compiled is None:
            compiled = compile_with(self._compiler, guide)
        return self._xgr.GrammarMatcher(compiled)

    def mask(self, logits: torch.Tensor, matchers: list[xgrammar.GrammarMatcher | None]) -> None:
        """Mask in place each row of `logits` whose matcher is set to the tokens it allows."""
        # A terminated matcher (its stop token accepted) has no next mask; its request ends.
        rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if not rows:
            return
        bitmask = self._xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i in rows:
            matcher = matchers[i]
            assert matcher is not None
            matcher.fill_next_token_bitmask(bitmask, i)
        self._xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.vocab_size, indices=rows
        )


class LazyGrammars:
    """A tokenizer's `Grammars`, built on first use (from any thread): an engine that never
    sees a guide never loads xgrammar's tokenizer info."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self._args = (hf_tokenizer, vocab_size, sorted(stop_token_ids))
        self._lock = threading.Lock()
        self.built: Grammars | None = None

    def get(self) -> Grammars:
        with self._lock:
            if self.built is None:
                self.built = Grammars(*self._args)
            return self.built
