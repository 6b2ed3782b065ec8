"""Where a prompt step's time goes: a wave of `--prompts` prompts of `--tokens` tokens each (the
vs_vllm table load's shape: 4 x 542) through pdserve's engine on SmolLM2 (the default step
budget of 2,048 tokens, as served: 4 x 542 is one step of 2,168, the fourth prompt's last 120
tokens taken with the rest rather than left for a step of their own), timed per call of
each part of every layer, summed over the layers: the linears (qkv, o, gate/up, down), the
compiled layer ops (norms, residual adds, rotary, silu_mul), the attention (of which the K/V
writes into the paged cache and the rows kernel), and the rest of the step (embedding, the
last norm and the output projection of the last rows, sampling, the engine's Python). Each
figure is the median over `--rounds` waves of fresh prompts, after two waves of warm-up; the
timers add ~1 us a call. This is what sessions 29-30 measured by hand to find where TTFT goes.

    .venv/bin/python benchmarks/prefill_breakdown.py [--prompts 4] [--tokens 542] [--rounds 5]

Writes benchmarks/results/prefill_breakdown.json (with the CPU model, its flags and the
instruction-set level pdserve chose).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from roofline import Engine

import pdserve.model.attention as attention
import pdserve.model.layers as layers
from pdserve.engine.sequence import SamplingParams
from pdserve.model.hugepages import thp_mode
from pdserve.model.isa import host_description

Spent = collections.Counter[str]


def timed(fn: Callable[..., Any], key: str, spent: Spent) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start

    return call


class TimedOps:
    """The compiled layer ops, each call timed under its own name."""

    def __init__(self, ops: Any, spent: Spent) -> None:
        self._ops, self._spent = ops, spent

    def __getattr__(self, name: str) -> Any:
        return timed(getattr(self._ops, name), name, self._spent)


def instrument(model: Any, spent: Spent) -> None:
    """Time every layer's linears and layer ops, and the attention (with its K/V writes and
    rows kernel, which it calls)."""
    decoder = model.model.layers if hasattr(model, "model") else model.layers
    for layer in decoder:
        attn, mlp = layer.self_attn, layer.mlp
        for module, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"),
                             (mlp, "down_proj")):  # fmt: skip
            linear = getattr(module, name)
            linear.forward = timed(linear.forward, name, spent)
        if layer.ops is not None:
            layer.use_ops(TimedOps(layer.ops, spent))
    layers.paged_attention = timed(layers.paged_attention, "attention", spent)
    attention.write_kv = timed(attention.write_kv, "attention: K/V writes", spent)
    attention._prefill_attention = timed(
        attention._prefill_attention, "attention: rows kernel and its inputs", spent
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=542)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default="benchmarks/results/prefill_breakdown.json")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    engine = Engine(args.dtype, args.threads)  # as benchmarks/roofline.py builds it
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def wave(seed: int) -> float:
        prompts = [[1000 + (seed * 97 + j * 31 + i) % 40000 for i in range(args.tokens)]
                   for j in range(args.prompts)]  # fmt: skip
        start = time.perf_counter()
        engine.engine.generate(prompts, params)
        return time.perf_counter() - start

    spent: Spent = collections.Counter()
    instrument(engine.engine.model, spent)
    for seed in range(2):
        wave(seed)
    waves: list[float] = []
    parts: dict[str, list[float]] = collections.defaultdict(list)
    for r in range(args.rounds):
        spent.clear()
        waves.append(wave(10 + r))
        for key, seconds in spent.items():
            parts[key].append(seconds)
        nested = spent["attention: K/V writes"] + spent["attention: rows kernel and its inputs"]
        top = sum(spent.values()) - nested
        parts["rest of the step"].append(waves[-1] - top)
    median = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
    result = {
        "host": host_description(),
        "transparent_huge_pages": thp_mode(),
        "threads": args.threads,
        "dtype": args.dtype,
        "model": "SmolLM2-135M-Instruct",
        "prompts": args.prompts,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "wave_ms": {"median": statistics.median(waves) * 1e3, "rounds": [w * 1e3 for w in waves]},
        "parts_ms": dict(sorted(median.items(), key=lambda kv: -kv[1])),
        "command": "prefill_breakdown.py "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "out"),
    }
    print(json.dumps({k: result[k] for k in ("wave_ms", "parts_ms")}, indent=2), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
