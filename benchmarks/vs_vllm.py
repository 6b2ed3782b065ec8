"""pdserve vs vLLM-CPU, side by side in one run, on the same machine, model and workloads.

Served: each system is started, driven by `pdserve bench`'s OpenAI client, and stopped before the
next starts -- pdserve colocated (`serve --role both`), pdserve disaggregated (`serve`: prefill on
core 0, decode on core 1), vLLM colocated and vLLM disaggregated (NIXL), the last two through the
launcher in ../shared/peers/. Offline: pdserve's `LLMEngine.generate` vs vLLM's `LLM.generate` on
identical token-id prompts, 4 and 16 in flight.

Served vs offline (the "pair", run first): pdserve colocated served and its engine offline on the
table workload at full size whatever --scale says, for --pair-rounds rounds, served first in even
rounds and offline first in odd ones, so that the host's drift does not land on one side.

Workloads (fixed seeds, ignore_eos, so every system produces exactly the same tokens):
  table    20 requests, 4 concurrent, 542-token prompts, 32 output tokens
  mixed64  64 requests, 16 concurrent, 128-1024-token prompts, 64-128 output tokens

The vLLM environment is built by `../shared/peers/vllm_peer_setup.sh DIR` (~10 min, ~4 GB; not
part of `make test`); without it this script says so and exits.

    .venv/bin/python benchmarks/vs_vllm.py [--vllm-dir /tmp/vllm-peer] [--only ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.client import LoadConfig, run_load
from pdserve.bench.dataset import BenchPrompt
from pdserve.bench.stats import summarize

MODEL = "SmolLM2-135M-Instruct"
HERE = Path(__file__).resolve().parent
PEERS = HERE.parent.parent / "shared" / "peers"
SYSTEMS = (
    "pdserve-colocated",
    "pdserve-disagg",
    "pdserve-colocated-int4",
    "vllm-colocated",
    "vllm-disagg",
)


@dataclass(frozen=True)
class Workload:
    name: str
    num: int
    concurrency: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]

    def scaled(self, scale: float) -> Workload:
        """Fewer requests (never fewer than the concurrency), same shape."""
        num = max(self.concurrency, round(self.num * scale))
        return Workload(self.name, num, self.concurrency, self.prompt_len, self.output_len)

    def prompts(self, seed: int = 0) -> list[BenchPrompt]:
        rng = random.Random(seed)
        out = []
        for _ in range(self.num):
            n = rng.randint(*self.prompt_len)
            # ordinary vocabulary ids (SmolLM2's special tokens are at the start of the vocabulary)
            ids = [rng.randrange(100, 49000) for _ in range(n)]
            out.append(BenchPrompt(ids, n, rng.randint(*self.output_len)))
        return out


WORKLOADS = (
    Workload("table", 20, 4, (542, 542), (32, 32)),
    Workload("mixed64", 64, 16, (128, 1024), (64, 128)),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


class Server:
    """One system under test as a process group; always stopped by `stop`."""

    def __init__(self, system: str, vllm_py: Path, vllm_model: Path, log_dir: Path) -> None:
        self.system = system
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if system.startswith("pdserve"):
            role = ["--role", "both", "--threads", "2"] if "colocated" in system else []
            extra = ["--quantization", "int4"] if system.endswith("-int4") else []
            # the same bound on a request as the vLLM peer's proxy (--request-timeout 600)
            extra += ["--request-timeout", "600"]
            cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(self.port), *role,
                   *extra]  # fmt: skip
        else:
            mode = "colocated" if "colocated" in system else "pd"
            cmd = [str(vllm_py), str(PEERS / "vllm_peer.py"), mode, "--port", str(self.port),
                   "--model", str(vllm_model), "--served-model-name", MODEL,
                   "--log-dir", str(log_dir / f"{system}-logs")]  # fmt: skip
        self.log_path = log_dir / f"{system}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float) -> float:
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.system} exited at start; see {self.log_path}")
            if healthy(self.url):
                return time.monotonic() - self.started
            time.sleep(0.5)
        raise TimeoutError(f"{self.system} not healthy within {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def drive(url: str, prompts: list[BenchPrompt], concurrency: int) -> dict[str, Any]:
    cfg = LoadConfig(url, MODEL, max_concurrency=concurrency)
    records, duration = asyncio.run(run_load(cfg, prompts, progress=False))
    summary = summarize(records, duration)
    summary.pop("goodput", None)
    summary.pop("slo", None)
    errors = [r.error for r in records if not r.ok]
    if errors:
        summary["first_error"] = errors[0]
    return summary


def run_served(system: str, args: argparse.Namespace, vllm: tuple[Path, Path] | None) -> Any:
    if system.startswith("vllm") and vllm is None:
        return {"skipped": "no vLLM environment"}
    vllm_py, vllm_model = vllm if vllm else (Path(), Path())
    server = Server(system, vllm_py, vllm_model, args.out)
    try:
        startup = server.wait_ready(args.ready_timeout)
        print(f"[{system}] ready in {startup:.0f}s", flush=True)
        warm = WORKLOADS[0].prompts(seed=99)[:4]
        drive(server.url, warm, 4)  # compiles, caches, first-call costs: outside the figures
        out: dict[str, Any] = {"startup_s": startup}
        for w in args.workloads:
            print(f"[{system}] {w.name}", flush=True)
            out[w.name] = drive(server.url, w.prompts(), w.concurrency)
            print(f"[{system}] {w.name}: {brief(out[w.name])}", flush=True)
        return out
    finally:
        server.stop()


def run_pair(args: argparse.Namespace, vllm: tuple[Path, Path] | None) -> dict[str, Any]:
    """Served vs offline, side by side: each round serves the full table workload on pdserve
    colocated (started, warmed, stopped) and runs the same prompts through the engine offline."""
    table = WORKLOADS[0]
    rounds: list[dict[str, Any]] = []
    for i in range(args.pair_rounds):
        # served first in even rounds, offline first in odd ones: a drift cancels over two
        served: Any = None
        offline: dict[str, Any] = {}
        for part in ("served", "offline") if i % 2 == 0 else ("offline", "served"):
            if part == "served":
                served = run_served("pdserve-colocated", argparse.Namespace(
                    **{**vars(args), "workloads": [table]}), vllm)  # fmt: skip
            else:
                offline = run_offline("pdserve", table, vllm, args.out / f"pair-offline-{i}")
        s = get(served, "table", "output_token_throughput")
        o = offline.get("output_token_throughput")
        rounds.append({"served": s, "offline": o, "ratio": ratio(s, o)})
        print(f"[pair] round {i}: served {s} tok/s, offline {o} tok/s", flush=True)
    served_all = [r["served"] for r in rounds]
    offline_all = [r["offline"] for r in rounds]
    done = None not in served_all and None not in offline_all
    return {
        "workload": table.__dict__,
        "rounds": rounds,
        "served_tok_s_mean": sum(served_all) / len(rounds) if done else None,
        "offline_tok_s_mean": sum(offline_all) / len(rounds) if done else None,
    }


def brief(s: dict[str, Any]) -> str:
    return (
        f"{s['output_token_throughput']:.1f} tok/s, TTFT p50 {s['ttft_ms'].get('p50', 0):.0f} ms,"
        f" ITL p50 {s['itl_ms'].get('p50', 0):.1f} ms, failed {s['failed']}"
    )


OFFLINE_PDSERVE = """
import json, sys, time, torch
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, default_cache_dir
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from pdserve.model.fetch import resolve_model
job = json.load(sys.stdin)
torch.set_num_threads(2)
engine = LLMEngine(EngineConfig(dtype="bfloat16", num_threads=2, quantization=job["quant"],
                   bf16_matmul=job["bf16_matmul"], cache=CacheConfig(kv_cache_memory=1024**3),
                   scheduler=SchedulerConfig(max_num_seqs=job["max_seqs"])),
                   resolve_model("default", default_cache_dir(), "bfloat16"))
def run(reqs):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in reqs]
    start = time.perf_counter()
    outs = engine.generate([p for p, _ in reqs], params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)
run(job["warmup"])
elapsed, tokens = run(job["requests"])
print("RESULT " + json.dumps({"elapsed_s": elapsed, "output_tokens": tokens}))
"""

OFFLINE_VLLM = """
import json, os, sys, time
job = json.load(sys.stdin)
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=job["model"], dtype=job["dtype"], max_num_seqs=job["max_seqs"],
          max_model_len=4096, seed=0)
def run(reqs):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in reqs]
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in reqs], params,
                        use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)
run(job["warmup"])
elapsed, tokens = run(job["requests"])
print("RESULT " + json.dumps({"elapsed_s": elapsed, "output_tokens": tokens}))
"""


def run_offline(engine: str, workload: Workload, vllm: tuple[Path, Path] | None, log: Path) -> Any:
    """`engine`: pdserve, pdserve-int4, pdserve-bf16-matmul (`--bf16-matmul bf16`: torch's bf16
    kernels even where they are emulated), vllm, or vllm-fp32 (the model in fp32: fp32
    activations and KV, not the bf16 model the others serve)."""
    if engine.startswith("vllm") and vllm is None:
        return {"skipped": "no vLLM environment"}
    reqs = [(p.prompt, p.output_len) for p in workload.prompts()]
    warm = [(p.prompt, p.output_len) for p in WORKLOADS[0].prompts(seed=99)[:4]]
    job = {
        "max_seqs": workload.concurrency,
        "requests": reqs,
        "warmup": warm,
        "quant": "int4" if engine.endswith("-int4") else "none",
        "bf16_matmul": "bf16" if engine.endswith("-bf16-matmul") else "auto",
        "dtype": "float32" if engine.endswith("-fp32") else "bfloat16",
    }
    env = dict(os.environ)
    if engine.startswith("vllm"):
        assert vllm is not None
        job["model"] = str(vllm[1])
        cmd = [str(vllm[0]), "-c", OFFLINE_VLLM]
        # as the peer's colocated server: both cores for vLLM's OpenMP threads (left to itself,
        # vLLM keeps one of two cores for its front end and computes on one thread)
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
                   VLLM_CPU_OMP_THREADS_BIND="0-1")  # fmt: skip
    else:
        cmd = [sys.executable, "-c", OFFLINE_PDSERVE]
    with open(log, "w") as f:
        proc = subprocess.run(
            cmd, input=json.dumps(job), stdout=subprocess.PIPE, stderr=f, text=True, env=env,
            timeout=1800,
        )  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}; see {log}"}
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["output_token_throughput"] = result["output_tokens"] / result["elapsed_s"]
    return result


def find_vllm(vllm_dir: Path) -> tuple[Path, Path] | None:
    py, model = vllm_dir / "venv" / "bin" / "python", vllm_dir / "smollm2-hf"
    if not (py.exists() and (model / "model.safetensors").exists()):
        return None
    probe = subprocess.run([str(py), "-c", "import vllm, aiohttp"], capture_output=True)
    return (py, model) if probe.returncode == 0 else None


def ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def ratios(
    served: dict[str, Any], offline: dict[str, Any], pair: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Each figure with its target; < or > as the issue states it. Served over offline comes
    from the pair when it ran (adjacent, full table load), else from the two main sections."""
    tput = lambda s, w: get(served, s, w, "output_token_throughput")  # noqa: E731
    p50 = lambda s, w, k: get(served, s, w, k, "p50")  # noqa: E731
    off = lambda e, w: get(offline, e, w, "output_token_throughput")  # noqa: E731
    rows = {
        "served_over_offline_table": (
            ratio(get(pair, "served_tok_s_mean"), get(pair, "offline_tok_s_mean")) if pair
            else ratio(tput("pdserve-colocated", "table"), off("pdserve", "table")), ">= 0.95"),
        "engine_vs_vllm_offline_4": (ratio(off("pdserve", "table"), off("vllm", "table")),
                                     ">= 1.0"),
        "engine_vs_vllm_offline_16": (ratio(off("pdserve", "mixed64"), off("vllm", "mixed64")),
                                      ">= 1.0"),
        "colocated_tok_s_vs_vllm": (ratio(tput("pdserve-colocated", "table"),
                                          tput("vllm-colocated", "table")), ">= 1.0"),
        "colocated_itl_p50_vs_vllm": (ratio(p50("pdserve-colocated", "table", "itl_ms"),
                                            p50("vllm-colocated", "table", "itl_ms")), "<= 1.0"),
        "disagg_ttft_p50_vs_vllm": (ratio(p50("pdserve-disagg", "table", "ttft_ms"),
                                          p50("vllm-disagg", "table", "ttft_ms")), "<= 0.5"),
        "disagg_itl_p50_vs_vllm": (ratio(p50("pdserve-disagg", "table", "itl_ms"),
                                         p50("vllm-disagg", "table", "itl_ms")), "<= 1.0"),
        "disagg_tok_s_vs_vllm": (ratio(tput("pdserve-disagg", "table"),
                                       tput("vllm-disagg", "table")), ">= 1.3"),
        "int4_colocated_tok_s_vs_vllm": (ratio(tput("pdserve-colocated-int4", "table"),
                                               tput("vllm-colocated", "table")), ">= 1.0"),
        "int4_colocated_itl_p50_vs_vllm": (ratio(p50("pdserve-colocated-int4", "table", "itl_ms"),
                                                 p50("vllm-colocated", "table", "itl_ms")),
                                           "<= 1.0"),
        "int4_engine_vs_vllm_offline_4": (ratio(off("pdserve-int4", "table"),
                                                off("vllm", "table")), ">= 1.0"),
        "int4_engine_vs_vllm_offline_16": (ratio(off("pdserve-int4", "mixed64"),
                                                 off("vllm", "mixed64")), ">= 1.0"),
        "int4_mixed64_colocated_tok_s_vs_vllm": (ratio(tput("pdserve-colocated-int4", "mixed64"),
                                                       tput("vllm-colocated", "mixed64")),
                                                 ">= 1.2"),
        "mixed64_colocated_tok_s_vs_vllm": (ratio(tput("pdserve-colocated", "mixed64"),
                                                  tput("vllm-colocated", "mixed64")), ">= 1.2"),
        "mixed64_disagg_tok_s_vs_vllm": (ratio(tput("pdserve-disagg", "mixed64"),
                                               tput("vllm-disagg", "mixed64")), ">= 1.2"),
    }  # fmt: skip
    out = {}
    for name, (value, target) in rows.items():
        met = None
        if value is not None:
            bound = float(target.split()[1])
            met = value >= bound if target.startswith(">=") else value <= bound
        out[name] = {"value": value, "target": target, "met": met}
    return out


def plot(result: dict[str, Any], out_dir: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(k, v["value"], v["target"], v["met"]) for k, v in result["ratios"].items()
            if v["value"]]  # fmt: skip
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    names = [f"{k}  ({t})" for k, _, t, _ in rows]
    values = [v for _, v, _, _ in rows]
    ax.barh(names, values, color=["tab:green" if met else "tab:red" for *_, met in rows])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("pdserve / reference (target in brackets; green: met)")
    ax.set_title("pdserve vs vLLM-CPU, one run on one machine")
    fig.tight_layout()
    fig.savefig(out_dir / "vs_vllm.png", dpi=120)
    return "vs_vllm.png"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vllm-dir", default=os.environ.get("VLLM_PEER_DIR", "/tmp/vllm-peer"))
    ap.add_argument(
        "--only",
        default="served,offline,pair",
        help="any of served, offline, pair (comma-separated)",
    )
    ap.add_argument("--pair-rounds", type=int, default=4)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--engines", default="pdserve,pdserve-int4,vllm",
                    help="offline engines (also: pdserve-bf16-matmul, vllm-fp32)")  # fmt: skip
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiplies request counts (never below the concurrency); 0.25 fits an "
        "AVX2-only 2-core machine, where bf16 is emulated, in ~40 minutes",
    )
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    vllm = find_vllm(Path(args.vllm_dir))
    if vllm is None:
        print(
            f"No vLLM environment in {args.vllm_dir}: build it with\n"
            f"  bash {PEERS / 'vllm_peer_setup.sh'} {args.vllm_dir}\n"
            "(~10 minutes, ~4 GB), or pass --vllm-dir.",
            file=sys.stderr,
        )
        return 2
    parts = set(args.only.split(","))
    served: dict[str, Any] = {}
    offline: dict[str, Any] = {}
    logs = Path(tempfile.mkdtemp(prefix="vs_vllm-"))  # outside the tree: the peer writes .py hooks
    args.workloads = [w.scaled(args.scale) for w in WORKLOADS]
    pair: dict[str, Any] | None = None
    if "pair" in parts:  # first: before any vLLM process has run on the machine
        pair = run_pair(argparse.Namespace(**{**vars(args), "out": logs}), vllm)
    if "offline" in parts:
        for engine in args.engines.split(","):
            offline[engine] = {}
            for w in args.workloads:
                print(f"[offline {engine}] {w.name}", flush=True)
                offline[engine][w.name] = run_offline(engine, w, vllm, logs / f"{engine}-{w.name}")
                print(f"[offline {engine}] {w.name}: {offline[engine][w.name]}", flush=True)
    if "served" in parts:
        for system in args.systems.split(","):
            served[system] = run_served(system, argparse.Namespace(**{**vars(args), "out": logs}),
                                        vllm)  # fmt: skip
            Path(args.out / "vs_vllm.partial.json").write_text(json.dumps(
                {"served": served, "offline": offline}, indent=2, default=str))  # fmt: skip
    result: dict[str, Any] = {
        "machine": {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine()},
        "model": MODEL,
        "workloads": [w.__dict__ for w in args.workloads],
        "scale": args.scale,
        "served": served,
        "offline": offline,
        "pair": pair,
        "ratios": ratios(served, offline, pair),
        "logs": str(logs),
    }
    path = args.out / "vs_vllm.json"
    path.write_text(json.dumps(result, indent=2, default=str))  # before plotting: kept whatever
    print(json.dumps(result["ratios"], indent=2))
    result["plot"] = plot(result, args.out)
    path.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
