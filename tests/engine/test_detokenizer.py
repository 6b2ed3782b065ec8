"""Incremental detokenization with SmolLM2's byte-level tokenizer: multi-byte characters
split across tokens, and stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.model.tokenizer import Tokenizer

TEXT = "Grüße aus 東京 🙂🎉! naïve café — done."


@pytest.fixture(scope="module")
def tokenizer(smollm_fp32_dir: Path) -> Tokenizer:
    return Tokenizer(smollm_fp32_dir)


def stream(tok: Tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok.decode, stop)
    deltas = []
    for i in range(1, len(ids) + 1):
        detok.update(ids[:i], final=i == len(ids))
        deltas.append(detok.delta(final=i == len(ids)))
        if detok.stopped:
            break
    return deltas, detok.text


def test_streamed_text_equals_full_decode_across_multibyte_chars(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    # The emoji and CJK characters take several byte-level tokens each.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    deltas, text = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_truncates_and_is_never_streamed(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    deltas, text = stream(tokenizer, ids, stop=("café",))
    assert text == "Grüße aus 東京 🙂🎉! naïve "
    assert "".join(deltas) == text
