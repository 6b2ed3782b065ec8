"""The weights in transparent huge pages (model/hugepages.py): what moves keeps its identity and
values, lands back to back in one mapping the kernel backs with 2 MiB pages (read from
/proc/self/smaps, not from our own bookkeeping), shared and opaque storages stay put, and a
model's output is bit-identical with its weights moved or not."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import pdserve.model.llama as llama
from pdserve.config import ModelConfig
from pdserve.engine.kv_cache import allocate_kv_cache
from pdserve.engine.sequence import SamplingParams
from pdserve.model import hugepages
from pdserve.model.hugepages import ALIGN, HUGE_PAGE, move_to_huge_pages, thp_mode
from tests.helpers import TINY_VOCAB, make_engine, make_tiny_model

needs_thp = pytest.mark.skipif(
    thp_mode() not in ("always", "madvise"),
    reason=f"this host's transparent huge pages are {thp_mode() or 'absent'!r}: weights stay "
    "in 4 KiB pages (exercised on a host with THP in 'always' or 'madvise' mode)",
)


def mapping_at(address: int) -> tuple[int, int]:
    """(Size, AnonHugePages), in kB, of the mapping of this process that holds `address`."""
    inside, size = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Size:":
            size = int(line.split()[1])
        elif inside and head == "AnonHugePages:":
            return size, int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def huge_kib_at(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds `address`."""
    return mapping_at(address)[1]


@needs_thp
def test_moved_tensors_keep_identity_and_values_back_to_back_in_huge_pages() -> None:
    torch.manual_seed(0)
    big = torch.randn(1 << 20)  # 4 MiB
    small = torch.randn(29).bfloat16()  # odd size: the next starts on a cache line
    tied = torch.randn(600_000)
    base = torch.randn(1000)
    view = base[10:20]
    before = {name: t.clone() for name, t in (("big", big), ("small", small), ("tied", tied))}
    base_ptr = base.data_ptr()

    moved = move_to_huge_pages([big, small, tied, tied, base, view])

    assert moved >= big.nbytes + small.nbytes + tied.nbytes
    assert torch.equal(big, before["big"]) and torch.equal(small, before["small"])
    assert torch.equal(tied, before["tied"])
    assert small.data_ptr() == big.data_ptr() + big.nbytes  # in order, back to back
    assert tied.data_ptr() == small.data_ptr() + ALIGN  # 58 bytes padded to one line
    assert big.data_ptr() % HUGE_PAGE == 0
    assert base.data_ptr() == base_ptr and view.data_ptr() == base_ptr + 40  # shared: stays
    assert huge_kib_at(big.data_ptr()) >= HUGE_PAGE >> 10


def test_nothing_moves_where_the_host_has_no_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    t = torch.randn(1 << 20)
    ptr = t.data_ptr()
    assert move_to_huge_pages([t]) == 0
    assert t.data_ptr() == ptr


def test_too_little_to_fill_a_huge_page_stays() -> None:
    t = torch.randn(1000)
    ptr = t.data_ptr()
    assert move_to_huge_pages([t]) == 0
    assert t.data_ptr() == ptr


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose weights fill a few huge pages (hidden 256: ~2.5 MB of bf16 a layer)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("wide"), hidden_size=256, intermediate_size=1024,
        num_hidden_layers=2, tie_word_embeddings=True,
    )  # fmt: skip


@needs_thp
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_loaded_models_weights_sit_in_huge_pages_and_generate_the_same(
    wide_model: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(wide_model, dtype)
    model = engine.model
    weights = [model.embed_tokens.weight]
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
            spec = linear.kernel_args()
            weights.append(spec[0] if spec is not None else linear.weight)
    for t in weights:
        assert huge_kib_at(t.data_ptr()) >= HUGE_PAGE >> 10
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: still one tensor

    monkeypatch.setattr(llama, "move_to_huge_pages", lambda tensors: 0)
    control = make_engine(wide_model, dtype)
    if thp_mode() == "madvise":  # ("always" backs torch's own large buffers with them too)
        # Left where torch put it, the weight lies in glibc's heap, a mapping shared with the
        # rest of the process in which THP may have backed a stray 2 MiB page elsewhere (a
        # suite's worker had one after ~700 tests): not a mapping of huge pages throughout.
        size, huge = mapping_at(control.model.embed_tokens.weight.data_ptr())
        assert huge < size // 2

    rng = random.Random(2)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in (9, 40, 23)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = [engine.generate(prompts, params), control.generate(prompts, params)]
    moved, kept = ([(o.token_ids, o.logprobs) for o in run] for run in outs)
    assert moved == kept  # bit for bit: the same values read from other pages


def tiny_windowed_config() -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=64,
        num_layers=2, num_heads=4, num_kv_heads=4, head_dim=64, rms_norm_eps=1e-6,
        rope_theta=1e4, max_position=1024, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=None, eos_token_ids=(), local_layers=(1,), sliding_window=16,
    )  # fmt: skip


def test_without_huge_pages_the_kv_caches_layers_are_page_aligned_and_zeroed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the host has no THP, a full-attention layer's cache still starts on a page (the
    transfer plane's blocks and the kernels' rows align as on a host with huge pages), every
    page zeroed, in a mapping of its own that holds no huge page."""
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    full, windowed = allocate_kv_cache(tiny_windowed_config(), 256, 16, torch.float32, lazy=True)
    for layer in (full, windowed):
        assert layer.data_ptr() % 4096 == 0 and layer.shape == (256, 2, 4, 16, 64)
    assert not full.any()
    assert huge_kib_at(full.data_ptr()) == 0


@needs_thp
def test_the_kv_caches_full_layers_sit_in_huge_pages_and_window_layers_do_not() -> None:
    """A full-attention layer's cache (read and written block by block wherever the pool put
    them, by attention and by the transfer plane) is backed by huge pages; a windowed layer's,
    a mapping of its own backed as each block is written (its own pages only), is not, in any
    THP mode, whatever THP did with the heap of the process (its mapping holds nothing else)."""
    blocks = 256  # 32 KiB a block: 8 MiB a layer
    full, windowed = allocate_kv_cache(tiny_windowed_config(), blocks, 16, torch.float32, lazy=True)
    assert full.data_ptr() % HUGE_PAGE == 0 and not full.any()  # zeroed
    assert huge_kib_at(full.data_ptr()) >= (full.nbytes >> 10) // 2  # the kernel's word
    windowed.fill_(1.0)  # every page written: none of them huge, in any THP mode
    assert windowed.data_ptr() % 4096 == 0
    assert huge_kib_at(windowed.data_ptr()) == 0
