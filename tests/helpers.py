"""Shared test helpers: tiny random checkpoints and the bundled SmolLM2 model."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import prepare_inputs
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import SamplingParams, Sequence

TINY_VOCAB = 256
# Torch threads of an engine in the test process: the cores shared among pytest-xdist's
# workers (two workers of two threads each on two cores made OpenMP spin against itself:
# compute tests ran 2-3x slower than alone).
THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def cache_dir() -> Path:
    env = os.environ.get("PDSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pdserve"


LOG_TAIL_CHARS = 6000
# The logs of the processes running now (`logs_kept_on_failure`): a failing test's report
# shows their tails (conftest.py), so a failure in CI, where the temp directory is gone,
# still says what the servers did.
live_logs: list[Callable[[], Iterable[Path]]] = []


def log_tails(logs: Iterable[Path]) -> str:
    tails = []
    for log in logs:
        try:
            text = log.read_text(errors="replace")
        except OSError as e:
            text = f"(unreadable: {e})"
        tails.append(f"----- {log} (last {LOG_TAIL_CHARS} chars) -----\n{text[-LOG_TAIL_CHARS:]}")
    return "\n".join(tails)


@contextmanager
def logs_kept_on_failure(
    request: pytest.FixtureRequest, logs: Callable[[], Iterable[Path]]
) -> Iterator[None]:
    """For a fixture's processes: their `logs` are removed after the block when no test failed
    while it ran, and kept (in the temp directory, for the failure's reader) otherwise; a
    failure's report shows their tails. Entered from a test's `finally` while its failure
    propagates (pytest counts it only later), the logs are kept and their tails printed."""
    failed = request.session.testsfailed
    failing = sys.exc_info()[1] is not None
    live_logs.append(logs)
    try:
        yield
    except BaseException:  # the block itself failed (a test's own server): tails now
        print(log_tails(logs()))
        raise
    finally:
        live_logs.remove(logs)
    if failing:
        print(log_tails(logs()))
    elif request.session.testsfailed == failed:
        for log in logs():
            log.unlink(missing_ok=True)


def named_logs(log: Path) -> list[Path]:
    """`log` and the logs it names (`log=PATH`, as `pdserve cluster` names its nodes' logs)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    named = dict.fromkeys(Path(p) for p in re.findall(r"\blog=(\S+)", text))
    return [log, *(p for p in named if p.exists())]


def save_tiny_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(out))


def make_tiny_model(out: Path, arch: str = "llama", **overrides: Any) -> Path:
    """A random Llama (or Qwen2, Qwen3, Mistral) saved as safetensors plus a word-level
    tokenizer."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    kwargs: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,
    )
    kwargs.update(overrides)
    torch.manual_seed(0)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 24, **kwargs}))  # not hidden/heads
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**kwargs))
    elif arch == "gemma":
        from transformers import GemmaConfig, GemmaForCausalLM

        model = GemmaForCausalLM(GemmaConfig(**{"head_dim": 32, **kwargs}))
        with torch.no_grad():  # HF initialises Gemma's norm weights to zero; make them matter
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0, 0.5)
    elif arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        # A local (sliding-window) layer between global ones: their RoPE bases differ; the
        # query scale is query_pre_attn_scalar's (256), not head_dim's.
        types = ["full_attention", "sliding_attention", "full_attention"]
        kwargs.pop("rope_theta")
        rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip
        config = {"head_dim": 32, "layer_types": types, "rope_parameters": rope, **kwargs}
        model = Gemma3ForCausalLM(Gemma3TextConfig(**config))
        with torch.no_grad():  # HF initialises Gemma's norm weights to zero; make them matter
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0, 0.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    if kwargs.get("attention_bias") or arch == "qwen2":
        with torch.no_grad():  # HF initialises biases to zero; make them matter
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    model.save_pretrained(str(out), safe_serialization=True)
    save_tiny_tokenizer(out)
    return out


def make_engine(
    model_dir: Path,
    dtype: str = "float32",
    num_blocks: int = 256,
    block_size: int = 16,
    prefix_caching: bool = True,
    max_num_seqs: int = 64,
    max_batched_tokens: int = 2048,
    bf16_matmul: str = "auto",
    quantization: str = "none",
) -> LLMEngine:
    config = EngineConfig(
        dtype=dtype,
        bf16_matmul=bf16_matmul,
        quantization=quantization,
        num_threads=THREADS,
        cache=CacheConfig(
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched_tokens
        ),
    )
    return LLMEngine(config, model_dir)


def engine_logits(
    engine: LLMEngine,
    token_ids: list[int],
    chunks: list[int],
    kernel: Any = None,
    last: int | None = None,
) -> torch.Tensor:
    """Logits at every position (or the `last` ones), computing the prompt in the given chunk
    sizes through the paged cache (a chunk of 1 takes the decode path): through torch's
    attention, or with `kernel` (`paged_decode_kernel()`) the compiled kernels."""
    seq = Sequence("logits", token_ids, SamplingParams(max_tokens=1))
    engine.kv.allocate(seq)
    rows = []
    try:
        with torch.inference_mode():
            for n in chunks:
                out = SchedulerOutput([ScheduledSeq(seq, n, sample=False)])
                window = engine.model_config.sliding_window
                inputs = prepare_inputs(out, engine.block_size, kernel, window=window)
                hidden = engine.model(
                    inputs.input_ids, inputs.positions, engine.kv_caches, inputs.meta
                )
                seq.num_computed_tokens += n
                if last is not None:  # only rows at positions len(token_ids) - last onwards
                    keep = seq.num_computed_tokens - (len(token_ids) - last)
                    hidden = hidden[max(0, hidden.shape[0] - keep) :]
                rows.append(engine.model.compute_logits(hidden))
    finally:
        engine.kv.free(seq)
    return torch.cat(rows)


def assert_all_free(engine: LLMEngine) -> None:
    engine.pool.check_integrity()
    assert engine.pool.num_free == engine.num_blocks, (
        f"{engine.num_blocks - engine.pool.num_free} blocks still used"
    )
    assert not engine.requests


def encode_threads(monkeypatch: Any) -> list[str]:
    """Spy on `Tokenizer.encode` (still run): the names of the threads it is called on."""
    import threading

    from pdserve.model.tokenizer import Tokenizer

    threads: list[str] = []
    encode = Tokenizer.encode

    def spy(self: Tokenizer, text: str) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(self, text)

    monkeypatch.setattr(Tokenizer, "encode", spy)
    return threads
