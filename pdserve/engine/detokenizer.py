"""Incremental detokenization: turns a growing list of token ids into text deltas, holding back
bytes of a multi-byte character until it is complete, and finds stop strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence

DecodeFn = Callable[[list[int]], str]


class IncrementalDetokenizer:
    """Decodes only a short window of recent tokens per step (prefix/read offsets), so the cost
    per token does not grow with the length of the output."""

    def __init__(self, decode: DecodeFn, stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self._decode = decode
        self._min_tokens = min_tokens  # stop strings count only from this many tokens on
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # all text decoded so far (truncated at a stop string)
        self._emitted = 0  # chars of `text` already handed out as deltas
        self.stopped = False

    def update(self, token_ids: list[int], final: bool = False) -> None:
        """Feed the full list of output token ids after new ones were appended. With `final`,
        an incomplete trailing character is emitted as the replacement character."""
        if self.stopped:
            return
        prefix = self._decode(token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return  # an incomplete character: wait for its remaining bytes
        start = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        if len(token_ids) >= self._min_tokens:
            self._find_stop(max(0, start - self._hold))

    def _find_stop(self, search_from: int) -> None:
        hits = [i for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def mark_sent(self, chars: int) -> None:
        """The first `chars` characters of `text` were handed out already (by a node that
        served this stream before): the next delta starts after them."""
        if not 0 <= chars <= len(self.text):
            raise ValueError(f"{chars} characters sent, but the text so far has {len(self.text)}")
        self._emitted = chars

    def delta(self, final: bool) -> str:
        """Text not yet handed out; while not final, keeps back what could begin a stop string."""
        end = (
            len(self.text)
            if final or self.stopped
            else max(self._emitted, len(self.text) - self._hold)
        )
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
