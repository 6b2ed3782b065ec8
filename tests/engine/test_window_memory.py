"""Sliding-window layers keep only their window's blocks: the memory a context holds, the
memory given back to the system, and outputs unchanged when the windows' parts of blocks are
few and reused all the time."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.kv_cache import PAGE, WindowMemory, allocate_kv_cache, cache_size
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from tests.helpers import THREADS, assert_all_free, make_tiny_model

# Gemma 3 270M's attention geometry: 18 layers, every 6th global, the others windowed at 512
# positions; tiny heads (fp32, head_dim 32: a layer's block of 16 tokens is one page).
LAYERS, EVERY, WINDOW, BLOCK = 18, 6, 512, 16
GEMMA3_TYPES = [
    "full_attention" if (i + 1) % EVERY == 0 else "sliding_attention" for i in range(LAYERS)
]


def engine(model_dir: Path, **cache: object) -> LLMEngine:
    config = EngineConfig(
        dtype="float32",
        num_threads=THREADS,
        cache=CacheConfig(block_size=BLOCK, **cache),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096),
    )
    return LLMEngine(config, model_dir)


@pytest.fixture(scope="module")
def gemma3_geometry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("gemma3-geometry"),
        "gemma3",
        num_hidden_layers=LAYERS,
        layer_types=GEMMA3_TYPES,
        sliding_window=WINDOW,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8192,
    )


def test_a_4096_token_gemma3_context_holds_under_0_30_of_full_attention_paging(
    gemma3_geometry: Path,
) -> None:
    """A 4,096-token context decoding on Gemma 3's layer geometry: the block pool holds every
    block of the 3 global layers and, of the 15 windowed ones, only the 33 blocks a window
    (and a handoff of the context) still reads: (3 x 257 + 15 x 33) / (18 x 257) = 0.27 of
    what paging every layer's every block holds."""
    e = engine(gemma3_geometry, kv_cache_memory=64 << 20)
    pool = e.pool
    assert pool.window_blocks is not None and pool.window_blocks < e.num_blocks  # sized apart
    prompt = [3 + (7 * i) % 250 for i in range(4096)]
    e.add_request("long", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    seen = []
    while e.requests:
        e.step()
        seq = e.requests.get("long")
        if seq is not None and seq.output_token_ids:
            held = (LAYERS - 15) * pool.num_used + 15 * pool.num_windows_held
            seen.append((pool.num_used, pool.num_windows_held, held / (LAYERS * pool.num_used)))
    assert seen and all(ratio <= 0.30 for _, _, ratio in seen), seen
    used, windows, ratio = seen[-1]
    # 4,098 tokens in the cache: a query at 4,096 (the last block's start) reads from 3,585
    assert used == 257 and windows == 257 - (4096 - WINDOW + 1) // BLOCK == 33
    assert ratio == pytest.approx((3 * 257 + 15 * 33) / (18 * 257))
    # as vllm:kv_cache_usage_perc reports it, the idle parts (cached, reusable) not counted
    assert_all_free(e)
    assert pool.usage() == 0.0


def test_budget_buys_more_blocks_with_window_parts_sized_apart(gemma3_geometry: Path) -> None:
    """The same memory buys (3 + 15) / (3 + 15 / 4) = 2.67x the blocks when the windowed
    layers' parts are a quarter of them; the windowed layers' tensors are not backed until
    written, so the cache's resident memory stays within the budget."""
    model = ModelConfig.from_dir(gemma3_geometry)
    budget = 64 << 20
    kept = cache_size(model, CacheConfig(BLOCK, budget, window_memory=False), torch.float32)
    apart = cache_size(model, CacheConfig(BLOCK, budget), torch.float32)
    layer_block = 2 * 1 * BLOCK * 32 * 4
    assert kept.window_blocks is None and kept.num_blocks == budget // (18 * layer_block)
    assert apart.num_blocks == budget // (3 * layer_block + 15 * layer_block // 4)
    assert apart.window_blocks == apart.num_blocks // 4
    assert apart.num_blocks / kept.num_blocks == pytest.approx(18 / 6.75, rel=0.01)


def _resident(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s pages that are backed by memory now (mincore: page by page)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = tensor.data_ptr()
    assert start % PAGE == 0
    size = tensor.numel() * tensor.element_size()
    pages = -(-size // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(start, size, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * PAGE


def test_window_memory_is_given_back_to_the_system() -> None:
    """A lazily allocated windowed layer is not backed until written (the full layer is, at
    once); the pages of its blocks, once dropped, are no longer backed and read as zeros."""
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=32,
        hidden_size=64,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position=1024,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=None,
        eos_token_ids=(),
        local_layers=(1,),
        sliding_window=16,
    )
    blocks = 512  # 4 heads x 64 dims x 16 slots x K/V x 4 bytes = 32 KiB a block: 16 MiB
    full, windowed = allocate_kv_cache(cfg, blocks, BLOCK, torch.float32, lazy=True)
    size = windowed[0].numel() * 4
    assert _resident(full) == size * blocks and _resident(windowed) == 0
    windowed.fill_(1.0)
    assert _resident(windowed) == size * blocks
    memory = WindowMemory([windowed])
    for b in range(0, blocks, 2):
        memory.drop(b)
    assert memory.bytes_returned == size * blocks // 2
    assert _resident(windowed) == size * blocks // 2
    assert windowed[0].abs().sum() == 0 and windowed[1].abs().sum() == size // 4


def test_outputs_are_unchanged_when_window_parts_are_few(tmp_path: Path) -> None:
    """A tiny Gemma 3 (window 24, blocks of 16) with 12 window parts for 96 blocks: 3 requests
    of 40-token prompts and one of 300 (19 blocks: more than there are parts, computed in
    chunks as parts free up) generating 150 tokens each (68 blocks in all) hold a few parts
    each beyond their prompts, parts go back and are reused all the time, and every output
    equals the same engine's with a part for every block (every block keeping every layer,
    as transformers' logits are checked against in test_logits.py)."""
    model_dir = make_tiny_model(tmp_path / "g3", "gemma3", sliding_window=24)
    prompts = [[3 + (11 * i + 5 * j) % 250 for j in range(300 if i == 2 else 40)] for i in range(4)]
    params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    reference = engine(model_dir, num_blocks=96, window_memory=False)
    assert reference.pool.window_blocks is None
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    few = engine(model_dir, num_blocks=96, num_window_blocks=12)
    dropped: list[int] = []
    on_drop = few.pool.on_drop
    few.pool.on_drop = lambda b: (dropped.append(b), on_drop(b))  # type: ignore[func-returns-value]
    got = [o.token_ids for o in few.generate(prompts, params)]
    assert got == expected
    assert len(set(dropped)) > 12  # more blocks had parts than there are parts
    assert_all_free(few)
    assert few.pool.num_windows_held == 0
