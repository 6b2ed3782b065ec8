"""Structured output: a request's `Guide` (a JSON schema, any JSON object, a regex, a choice of
strings or an EBNF grammar) compiled by xgrammar for the model's tokenizer into a matcher that
follows the output token by token; before each sampling the matcher's token bitmask masks the
request's logits row, so batching is unchanged. A remotely prefilled request's guide travels
with it: prefill samples the first token under its own matcher, decode's matcher accepts that
token and continues."""

from __future__ import annotations

import json
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


class Grammars:
    """Compiles guides for one tokenizer (xgrammar, with its compile cache) and masks logits."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        # Compiled grammars are cached (a repeated schema compiles once), within a bound.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_BYTES)
        self.vocab_size = vocab_size

    def matcher(self, guide: Guide) -> xgrammar.GrammarMatcher:
        c = self._compiler
        try:
            if guide.kind == GuideKind.JSON_OBJECT:
                compiled = c.compile_json_schema('{"type": "object"}')  # OpenAI's json_object
            elif guide.kind == GuideKind.JSON_SCHEMA:
                compiled = c.compile_json_schema(guide.spec)
            elif guide.kind == GuideKind.REGEX:
                compiled = c.compile_regex(guide.spec)
            elif guide.kind == GuideKind.CHOICE:
                compiled = c.compile_grammar(_choice_grammar(guide.spec))
            else:
                compiled = c.compile_grammar(guide.spec)
        except Exception as e:  # xgrammar raises RuntimeError, ValueError or its own types
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            detail = detail.split(": ", 1)[-1] if "] /" in detail else detail
            raise GuideError(f"{guide.kind.value}: cannot be compiled: {detail}") from e
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
