"""pdserve against this host's own limits, side by side in one run: the peak bf16 and fp32 GEMM
rate torch reaches here (the best of a few large square matmuls; where bf16 is emulated, the fp32
rate, the fastest way to multiply bf16 there), the rate at which the CPU
streams memory (the best of a few reductions over a buffer the size of the model's weights, in
4 KiB pages and in 2 MiB ones, as pdserve holds its weights where the host has them),
then pdserve's 512-token SmolLM2 prefill as a fraction of the GEMM peak (FLOPs of the linears /
time) and its batch-1 decode step as a multiple of the time to stream the weights once. Each
measurement is the median of `--rounds` rounds, the systems alternating within a round.

    .venv/bin/python benchmarks/roofline.py [--rounds 5] [--dtypes bfloat16 float32]

Writes benchmarks/results/roofline.json (with the CPU model, its SIMD flags, torch's and
pdserve's versions and the instruction-set level pdserve chose).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, default_cache_dir
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from pdserve.model.fetch import resolve_model
from pdserve.model.heap import keep_freed_memory
from pdserve.model.hugepages import huge_page_buffer, thp_mode
from pdserve.model.isa import chosen_isa, host_description
from pdserve.model.linear import Linear

PREFILL = 512
DECODE_STEPS = 64
GEMM_SIZES = (1024, 2048)


def seconds(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def gemm_flops(dtype: torch.dtype, size: int) -> float:
    """FLOP/s of one size x size x size matmul (after a warm-up one): the better of torch's
    matmul and oneDNN's with the weight packed once (what pdserve's linears use; in fp32 on an
    AMD EPYC it ran ~1.3x torch's matmul, which goes through MKL there)."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    torch.matmul(a, b)
    best = 2 * size**3 / seconds(lambda: torch.matmul(a, b))
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), size)
        except RuntimeError:  # no packed bf16 where the CPU lacks native bf16 (AVX2)
            return best

        def onednn() -> Any:
            return torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")

        onednn()
        best = max(best, 2 * size**3 / seconds(onednn))
    return best


def stream_bytes_per_s(buffers: list[torch.Tensor]) -> float:
    """Bytes/s of the fastest of a few full passes over each buffer (each reads every byte
    once; `max`, as `sum` widens to int64 and runs far slower)."""
    return max(b.numel() * b.element_size() / min(seconds(b.view(torch.int32).max)
                                                  for _ in range(3))
               for b in buffers)  # fmt: skip


class Engine:
    """pdserve on SmolLM2 in one dtype: a 512-token prefill and batch-1 decode steps."""

    def __init__(self, dtype: str, threads: int) -> None:
        keep_freed_memory()  # as a pdserve process does (cli.main)
        config = EngineConfig(
            dtype=dtype,
            num_threads=threads,
            cache=CacheConfig(kv_cache_memory=512 * 1024**2, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=2048),
        )
        self.engine = LLMEngine(config, resolve_model("default", default_cache_dir(), dtype))
        model = self.engine.model
        cfg = model.config
        self.linear_params = sum(
            m.in_features * m.out_features  # the weight may be held in panels
            for name, m in model.named_modules()
            if name.startswith("layers.") and isinstance(m, Linear)
        )
        # a decode step reads every layer's weights and the output projection once
        self.weight_bytes = (self.linear_params + cfg.vocab_size * cfg.hidden_size) * (
            2 if dtype == "bfloat16" else 4
        )
        self.run(list(range(1000, 1064)), 2)  # warm up

    def run(self, prompt: list[int], max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return seconds(lambda: self.engine.generate([prompt], params))

    def prefill_s(self, seed: int) -> float:
        return self.run([1000 + (seed * 7 + i) % 40000 for i in range(PREFILL)], 1)

    def decode_step_s(self, seed: int) -> float:
        prompt = [2000 + seed + i for i in range(16)]
        return (self.run(prompt, DECODE_STEPS + 1) - self.run(prompt, 1)) / DECODE_STEPS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--out", default="benchmarks/results/roofline.json")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "host": host_description(),
        "threads": args.threads,
        "transparent_huge_pages": thp_mode(),
        "rounds": {},
    }
    for dtype in args.dtypes:
        torch_dtype = getattr(torch, dtype)
        engine = Engine(dtype, args.threads)
        weights = [torch.ones(engine.weight_bytes // 4, dtype=torch.int32)]
        huge = huge_page_buffer(engine.weight_bytes // 4 * 4)
        if huge is not None:  # the weights' own pages (model/hugepages.py)
            weights.append(huge.view(torch.int32).fill_(1))
        samples: dict[str, list[float]] = {"gemm": [], "stream": [], "prefill": [], "step": []}
        for r in range(args.rounds):
            peak = max(gemm_flops(torch_dtype, n) for n in GEMM_SIZES)
            if torch_dtype == torch.bfloat16 and not chosen_isa().native_bf16:
                # bf16 is emulated (AVX2: torch's bf16 matmul ran at ~1 GFLOP/s): the fastest
                # way to multiply bf16 here is in fp32, so its peak is the reference
                peak = max(peak, *(gemm_flops(torch.float32, n) for n in GEMM_SIZES))
            samples["gemm"].append(peak)
            samples["stream"].append(stream_bytes_per_s(weights))
            samples["prefill"].append(engine.prefill_s(r))
            samples["step"].append(engine.decode_step_s(r))
        del weights, huge
        median = {k: statistics.median(v) for k, v in samples.items()}
        prefill_flops = 2 * PREFILL * engine.linear_params
        stream_s = engine.weight_bytes / median["stream"]
        result[dtype] = {
            "gemm_peak_gflops": median["gemm"] / 1e9,
            "stream_gb_per_s": median["stream"] / 1e9,
            "weight_bytes": engine.weight_bytes,
            "linear_params": engine.linear_params,
            "prefill_512_s": median["prefill"],
            "prefill_512_tok_s": PREFILL / median["prefill"],
            "prefill_linear_gflops": prefill_flops / median["prefill"] / 1e9,
            "prefill_fraction_of_gemm_peak": prefill_flops / median["prefill"] / median["gemm"],
            "decode_b1_step_ms": median["step"] * 1e3,
            "weight_stream_ms": stream_s * 1e3,
            "decode_step_over_weight_stream": median["step"] / stream_s,
        }
        result["rounds"][dtype] = samples
        del engine
        print(json.dumps(result[dtype], indent=2), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
