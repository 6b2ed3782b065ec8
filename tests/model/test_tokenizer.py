"""The compiled tokenizer (the Rust tokenizer transformers built, stored in the model cache so
that a node starts without importing transformers) encodes, decodes and names its eos exactly as
transformers' own tokenizer of the same files does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.model.tokenizer import Tokenizer
from tests.helpers import save_tiny_tokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>"]
# Text with the pieces tokenizers treat specially: special-token strings, spaces and newlines,
# multi-byte characters, words of the tiny word-level vocabulary.
TEXT = st.lists(
    st.one_of(
        st.text(max_size=12),
        st.sampled_from(SPECIALS + [" ", "  ", "\n", "\t", "é", "東京", "🙂", "t5", "t17 t3"]),
    ),
    max_size=12,
).map("".join)


def tokenizer_files(model_dir: Path, out: Path) -> Path:
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module", params=["smollm2", "tiny"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "smollm2":
        source = request.getfixturevalue("smollm_fp32_dir")
        return tokenizer_files(source, tmp_path_factory.mktemp("tok") / "smollm2")
    out = tmp_path_factory.mktemp("tok") / "tiny"
    save_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def pair(model: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """(a Tokenizer loaded from its compiled form in the cache, transformers' tokenizer)."""
    from transformers import AutoTokenizer

    cache = tmp_path_factory.mktemp("cache")
    Tokenizer(model, cache_dir=cache)  # compiles and stores
    return Tokenizer(model, cache_dir=cache), AutoTokenizer.from_pretrained(str(model))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXT)
def test_encode_equals_transformers(pair, text: str) -> None:  # type: ignore[no-untyped-def]
    ours, hf = pair
    assert ours.encode(text) == hf.encode(text, add_special_tokens=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans())
def test_decode_equals_transformers(pair, data: st.DataObject, skip: bool) -> None:  # type: ignore[no-untyped-def]
    ours, hf = pair
    ids = data.draw(st.lists(st.integers(0, len(hf) - 1), max_size=24))
    assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_eos_and_vocabulary_equal_transformers(pair) -> None:  # type: ignore[no-untyped-def]
    ours, hf = pair
    assert hf.eos_token_id in ours.eos_token_ids
    assert ours.vocab_size == len(hf)
    assert set(ours.special_strings) == {
        t.content for t in hf.added_tokens_decoder.values() if t.special
    }


def test_a_node_start_loads_the_compiled_tokenizer_without_transformers(
    smollm_fp32_dir: Path, tmp_path: Path
) -> None:
    model = tokenizer_files(smollm_fp32_dir, tmp_path / "model")
    Tokenizer(model, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1
    probe = (
        "import sys\n"
        "from pdserve.model.tokenizer import Tokenizer\n"
        f"tok = Tokenizer({str(model)!r}, cache_dir={str(tmp_path / 'cache')!r})\n"
        "ids = tok.encode('Hello, world!')\n"
        "print(tok.decode(ids), 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["Hello,", "world!", "False"]


def test_changed_tokenizer_files_are_compiled_anew_and_a_corrupt_entry_is_rebuilt(
    smollm_fp32_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    model = tokenizer_files(smollm_fp32_dir, tmp_path / "model")
    cache = tmp_path / "cache"
    before = Tokenizer(model, cache_dir=cache).eos_token_ids
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|endoftext|>"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    after = Tokenizer(model, cache_dir=cache).eos_token_ids
    assert after != before
    assert after == {AutoTokenizer.from_pretrained(str(model)).eos_token_id}

    assert len(list((cache / "tokenizers").iterdir())) == 2  # one per version
    shutil.rmtree(cache)
    Tokenizer(model, cache_dir=cache)
    [entry] = (cache / "tokenizers").iterdir()
    entry.write_text("{not json")
    assert Tokenizer(model, cache_dir=cache).eos_token_ids == after
    json.loads(entry.read_text())  # stored again, whole
