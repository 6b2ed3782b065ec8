"""pdserve vs vLLM-CPU, side by side in one run, on the same machine, model and workloads.

Served: each system is started, driven by `pdserve bench`'s OpenAI client, and stopped before the
next starts, alone on the host: pdserve colocated (`serve --role both`), pdserve disaggregated
(`serve`: prefill on core 0, decode on core 1), vLLM colocated and vLLM disaggregated (NIXL),
each in bf16 and in fp32 (vLLM through peers/vllm_peer.py). --rounds rounds, the order of the
systems reversed in every other round, so that the host's drift does not land on one side; every
figure is the median over the rounds. Each metric of pdserve (bf16, its default) is compared
with vLLM's better dtype for that metric, and pdserve fp32 with vLLM fp32. TTFT and ITL at p50
and p99, output tok/s, and the peak resident memory of the system's processes.

Served vs offline (the "pair", run first): pdserve colocated served and its engine offline on the
table workload at full size whatever --scale says, for --pair-rounds rounds, served first in even
rounds and offline first in odd ones. Offline (--only offline): pdserve's `LLMEngine.generate`
vs vLLM's `LLM.generate` on identical token-id prompts.

Workloads (fixed seeds, ignore_eos, so every system produces exactly the same tokens):
  table    20 requests, 4 concurrent, 542-token prompts, 32 output tokens
  mixed64  64 requests, 16 concurrent, 128-1024-token prompts, 64-128 output tokens (--workloads)
  single   8 requests, one at a time, 542-token prompts, 32 output tokens: a prompt's own TTFT
           (under `table` a disaggregated prefill node is saturated and TTFT is mostly queue)
  shared   as single, every prompt's first 32 tokens the same (a chat template's system prompt):
           each prompt after the first finds them in the prefix cache

The vLLM environment is built by `benchmarks/peers/vllm_peer_setup.sh DIR` (~10 min, ~4 GB; not
part of `make test`); without it this script says so and exits. `--model gemma3-270m`: Gemma 3
270M instead (pdserve serves its bundled GGUF; vLLM the same weights as bf16 safetensors,
converted once by `peers/gemma3_hf.py` into DIR/gemma3-hf); results in vs_vllm-gemma3-270m.json.

    .venv/bin/python benchmarks/vs_vllm.py [--vllm-dir /tmp/vllm-peer] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.client import LoadConfig, run_load
from pdserve.bench.dataset import BenchPrompt
from pdserve.bench.stats import summarize
from pdserve.model.isa import host_description
from pdserve.serve.launcher import free_port

MODEL = "SmolLM2-135M-Instruct"  # the served model's name (--model gemma3-270m: Gemma 3's)
PDSERVE_MODEL = ["default"]  # pdserve's --model
HERE = Path(__file__).resolve().parent
PEERS = HERE / "peers"
# <engine>-<colocated|disagg>-<bf16|fp32|int4> (int4: bf16 activations, int4 weights)
SYSTEMS = tuple(
    f"{engine}-{mode}-{dtype}"
    for engine in ("pdserve", "vllm")
    for mode in ("colocated", "disagg")
    for dtype in ("bf16", "fp32")
)
DTYPE = {"bf16": "bfloat16", "fp32": "float32", "int4": "bfloat16"}
PDSERVE_ARGS: list[str] = []  # more `pdserve serve` arguments (--pdserve-args)


@dataclass(frozen=True)
class Workload:
    name: str
    num: int
    concurrency: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    shared: int = 0  # the first tokens of every prompt, the same in all

    def scaled(self, scale: float) -> Workload:
        """Fewer requests (never fewer than the concurrency), same shape."""
        num = max(self.concurrency, round(self.num * scale))
        return dataclasses.replace(self, num=num)

    def prompts(self, seed: int = 0) -> list[BenchPrompt]:
        rng = random.Random(seed)
        # ordinary vocabulary ids (SmolLM2's special tokens are at the start of the vocabulary)
        shared = [rng.randrange(100, 49000) for _ in range(self.shared)]
        out = []
        for _ in range(self.num):
            n = rng.randint(*self.prompt_len)
            ids = shared + [rng.randrange(100, 49000) for _ in range(n - len(shared))]
            out.append(BenchPrompt(ids, n, rng.randint(*self.output_len)))
        return out


WORKLOADS = (
    Workload("table", 20, 4, (542, 542), (32, 32)),
    Workload("mixed64", 64, 16, (128, 1024), (64, 128)),
    # one request at a time: a prompt's own time to first token, without a queue in front of it
    Workload("single", 8, 1, (542, 542), (32, 32)),
    # the same, each prompt after the first hitting the prefix cache for its first 32 tokens
    Workload("shared", 8, 1, (542, 542), (32, 32), shared=32),
)


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
        engine, mode, variant = system.split("-")
        dtype = DTYPE[variant]
        if engine == "pdserve":
            role = ["--role", "both", "--threads", "2"] if mode == "colocated" else []
            extra = ["--quantization", "int4"] if variant == "int4" else []
            # the same bound on a request as the vLLM peer's proxy (--request-timeout 600)
            extra += ["--request-timeout", "600", "--dtype", dtype, *PDSERVE_ARGS]
            cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(self.port), *role,
                   "--model", PDSERVE_MODEL[0], "--served-model-name", MODEL, *extra]  # fmt: skip
        else:
            peer = "colocated" if mode == "colocated" else "pd"
            cmd = [str(vllm_py), str(PEERS / "vllm_peer.py"), peer, "--port", str(self.port),
                   "--model", str(vllm_model), "--served-model-name", MODEL, "--dtype", dtype,
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


def tree_rss_bytes(root: int) -> int:
    """Resident memory of `root` and every process below it (the peer's servers run in sessions
    of their own, so the tree, not the process group)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parents.items() if p == pid and c not in tree]
        tree.update(children)
        frontier.extend(children)
    total = 0
    for pid in tree:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except OSError:
            continue
    return total * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Samples a process tree's resident memory every `period` seconds until stopped."""

    def __init__(self, root: int, period: float = 0.5) -> None:
        self.root, self.period, self.peak = root, period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss_bytes(self.root))
            self._stop.wait(self.period)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


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
        memory = PeakMemory(server.proc.pid)
        warm = WORKLOADS[0].prompts(seed=99)[:4]
        drive(server.url, warm, 4)  # compiles, caches, first-call costs: outside the figures
        out: dict[str, Any] = {"startup_s": startup}
        for w in args.workloads:
            out[w.name] = drive(server.url, w.prompts(), w.concurrency)
            print(f"[{system}] {w.name}: {brief(out[w.name])}", flush=True)
        out["peak_rss_mib"] = memory.stop() / 2**20
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
                served = run_served("pdserve-colocated-bf16", argparse.Namespace(
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
        f"{s['output_token_throughput']:.1f} tok/s, TTFT p50 {s['ttft_ms'].get('p50', 0):.0f} ms"
        f" (mean {s['ttft_ms'].get('mean', 0):.0f}),"
        f" ITL p50 {s['itl_ms'].get('p50', 0):.1f} ms, p99 {s['itl_ms'].get('p99', 0):.1f} ms,"
        f" failed {s['failed']}"
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


def find_vllm(vllm_dir: Path, name: str = "default") -> tuple[Path, Path] | None:
    py, model = vllm_dir / "venv" / "bin" / "python", vllm_dir / "smollm2-hf"
    if name == "gemma3-270m" and py.exists():
        model = vllm_dir / "gemma3-hf"
        subprocess.run([sys.executable, str(PEERS / "gemma3_hf.py"), str(model)], check=True)
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


METRICS = {  # name -> (path in a served result, True where more is better)
    "tok_s": (("output_token_throughput",), True),
    "ttft_p50": (("ttft_ms", "p50"), False),
    "ttft_p99": (("ttft_ms", "p99"), False),
    # a closed loop's waves: where a server takes a wave's first arrival alone and the rest in
    # the next step, its TTFTs split in two groups and the p50 lands in either (vLLM's did on
    # the Zen 5: 761 / 581 / 586 ms in three rounds at one mean); the mean shows the split
    "ttft_mean": (("ttft_ms", "mean"), False),
    "itl_p50": (("itl_ms", "p50"), False),
    "itl_p99": (("itl_ms", "p99"), False),
}
# (pdserve system, vLLM systems whose better value is the reference, metric, target or None)
TARGETS = [
    ("pdserve-colocated-bf16", "vllm-colocated", "tok_s", ">= 1.2"),
    ("pdserve-colocated-bf16", "vllm-colocated", "ttft_p50", "<= 0.8"),
    ("pdserve-colocated-bf16", "vllm-colocated", "ttft_p99", None),
    ("pdserve-colocated-bf16", "vllm-colocated", "ttft_mean", None),
    ("pdserve-colocated-bf16", "vllm-colocated", "itl_p50", "<= 0.9"),
    ("pdserve-colocated-bf16", "vllm-colocated", "itl_p99", "<= 1.0"),
    ("pdserve-disagg-bf16", "vllm-disagg", "ttft_p50", "<= 0.8"),
    ("pdserve-disagg-bf16", "vllm-disagg", "ttft_p99", None),
    ("pdserve-disagg-bf16", "vllm-disagg", "ttft_mean", None),
    ("pdserve-disagg-bf16", "vllm-disagg", "tok_s", ">= 1.2"),
    ("pdserve-disagg-bf16", "vllm-disagg", "itl_p50", "<= 1.0"),
    ("pdserve-disagg-bf16", "vllm-disagg", "itl_p99", None),
    ("pdserve-colocated-fp32", "vllm-colocated-fp32", "tok_s", ">= 1.0"),
    ("pdserve-colocated-fp32", "vllm-colocated-fp32", "itl_p50", None),
    ("pdserve-disagg-fp32", "vllm-disagg-fp32", "tok_s", ">= 1.0"),
]


def median(values: list[float]) -> float | None:
    values = sorted(v for v in values if isinstance(v, (int, float)))
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def aggregate(rounds: list[Any], workload: str) -> dict[str, Any]:
    """Each metric's median over the rounds (and the rounds' values), and the peak memory."""
    out: dict[str, Any] = {}
    for name, (path, _) in METRICS.items():
        values = [get(r, workload, *path) for r in rounds]
        out[name] = {"median": median(values), "rounds": values}
    peaks = [get(r, "peak_rss_mib") for r in rounds]
    out["peak_rss_mib"] = {"median": median(peaks), "rounds": peaks}
    out["failed"] = sum(get(r, workload, "failed") or 0 for r in rounds)
    return out


def reference(summary: dict[str, Any], prefix: str, metric: str) -> tuple[str | None, Any]:
    """vLLM's better system among those named `prefix*` for `metric`: (system, median)."""
    higher = METRICS[metric][1]
    found = [(s, get(v, metric, "median")) for s, v in summary.items() if s.startswith(prefix)]
    found = [(s, v) for s, v in found if v is not None]
    if not found:
        return None, None
    return (max if higher else min)(found, key=lambda item: item[1])


def ratios(
    summary: dict[str, Any], offline: dict[str, Any], pair: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Each figure with its target (< or > as the issue states it; None: reported only),
    pdserve's median over vLLM's better dtype's median."""
    rows: dict[str, Any] = {}
    for ours, prefix, metric, target in TARGETS:
        ref_system, ref_value = reference(summary, prefix, metric)
        value = ratio(get(summary, ours, metric, "median"), ref_value)
        rows[f"{ours}_{metric}"] = {"value": value, "target": target, "vs": ref_system}
    for ours, prefix in (("pdserve-colocated-bf16", "vllm-colocated"),
                         ("pdserve-disagg-bf16", "vllm-disagg")):  # fmt: skip
        ref_system, ref_value = min(
            ((s, get(v, "peak_rss_mib", "median")) for s, v in summary.items()
             if s.startswith(prefix) and get(v, "peak_rss_mib", "median")),
            key=lambda item: item[1], default=(None, None),
        )  # fmt: skip
        rows[f"{ours}_peak_rss"] = {
            "value": ratio(get(summary, ours, "peak_rss_mib", "median"), ref_value),
            "target": None,
            "vs": ref_system,
        }
    if pair:
        served, off = get(pair, "served_tok_s_mean"), get(pair, "offline_tok_s_mean")
        rows["served_over_offline_table"] = {"value": ratio(served, off), "target": ">= 0.95"}
    off = lambda e, w: get(offline, e, w, "output_token_throughput")  # noqa: E731
    for engine in offline:
        if engine.startswith("pdserve"):
            for w in offline[engine]:
                rows[f"offline_{engine}_{w}_vs_vllm"] = {
                    "value": ratio(off(engine, w), off("vllm", w)), "target": None}  # fmt: skip
    for row in rows.values():
        value, target = row["value"], row["target"]
        row["met"] = None
        if value is not None and target is not None:
            bound = float(target.split()[1])
            row["met"] = value >= bound if target.startswith(">=") else value <= bound
    return rows


def plot(result: dict[str, Any], out_dir: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(k, v["value"], v["target"] or "reported", v["met"])
            for k, v in result["ratios"].items() if v["value"]]  # fmt: skip
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    names = [f"{k}  ({t})" for k, _, t, _ in rows]
    values = [v for _, v, _, _ in rows]
    colours = {True: "tab:green", False: "tab:red", None: "tab:gray"}
    ax.barh(names, values, color=[colours[met] for *_, met in rows])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("pdserve / vLLM's better dtype (target in brackets; green: met)")
    ax.set_title(
        f"pdserve vs vLLM-CPU, medians of {result['rounds']} rounds, {result['host']['cpu']}"
    )
    fig.tight_layout()
    name = "vs_vllm.png" if PDSERVE_MODEL[0] == "default" else f"vs_vllm-{PDSERVE_MODEL[0]}.png"
    fig.savefig(out_dir / name, dpi=120)
    return name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vllm-dir", default=os.environ.get("VLLM_PEER_DIR", "/tmp/vllm-peer"))
    ap.add_argument(
        "--only", default="served,pair", help="any of served, offline, pair (comma-separated)"
    )
    ap.add_argument("--rounds", type=int, default=3, help="served rounds (order alternating)")
    ap.add_argument("--pair-rounds", type=int, default=4)
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="also: pdserve-colocated-int4")  # fmt: skip
    ap.add_argument(
        "--workloads",
        default="table",
        help="table, mixed64, single and/or shared (the first one's ratios are the summary)",
    )
    ap.add_argument("--engines", default="pdserve,vllm",
                    help="offline engines (also: pdserve-int4, pdserve-bf16-matmul, "
                         "vllm-fp32)")  # fmt: skip
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--pdserve-args", default="", help="more `pdserve serve` arguments")
    ap.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiplies request counts (never below the concurrency)",
    )
    ap.add_argument("--model", default="default", choices=("default", "gemma3-270m"))
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    global MODEL
    if args.model != "default":
        MODEL = "gemma-3-270m"
        PDSERVE_MODEL[0] = args.model
    PDSERVE_ARGS.extend(args.pdserve_args.split())
    args.out.mkdir(parents=True, exist_ok=True)
    vllm = find_vllm(Path(args.vllm_dir), args.model)
    if vllm is None:
        print(
            f"No vLLM environment in {args.vllm_dir}: build it with\n"
            f"  bash {PEERS / 'vllm_peer_setup.sh'} {args.vllm_dir}\n"
            "(~10 minutes, ~4 GB), or pass --vllm-dir.",
            file=sys.stderr,
        )
        return 2
    parts = set(args.only.split(","))
    chosen = set(args.workloads.split(","))
    offline: dict[str, Any] = {}
    logs = Path(tempfile.mkdtemp(prefix="vs_vllm-"))  # outside the tree: the peer writes .py hooks
    args.workloads = [w.scaled(args.scale) for w in WORKLOADS if w.name in chosen]
    run_args = argparse.Namespace(**{**vars(args), "out": logs})
    pair: dict[str, Any] | None = None
    if "pair" in parts:  # first: before any vLLM process has run on the machine
        pair = run_pair(run_args, vllm)
    if "offline" in parts:
        for engine in args.engines.split(","):
            offline[engine] = {}
            for w in args.workloads:
                print(f"[offline {engine}] {w.name}", flush=True)
                offline[engine][w.name] = run_offline(engine, w, vllm, logs / f"{engine}-{w.name}")
                print(f"[offline {engine}] {w.name}: {offline[engine][w.name]}", flush=True)
    systems = args.systems.split(",")
    served: dict[str, list[Any]] = {s: [] for s in systems}
    if "served" in parts:
        for r in range(args.rounds):
            for system in systems if r % 2 == 0 else systems[::-1]:
                print(f"[round {r}] {system}", flush=True)
                served[system].append(run_served(system, run_args, vllm))
                Path(args.out / "vs_vllm.partial.json").write_text(json.dumps(
                    {"served": served, "pair": pair}, indent=2, default=str))  # fmt: skip
    table = args.workloads[0].name if args.workloads else "table"
    summary = {s: aggregate(rounds, table) for s, rounds in served.items() if rounds}
    result: dict[str, Any] = {
        "host": host_description(),
        "model": MODEL,
        "workloads": [w.__dict__ for w in args.workloads],
        "scale": args.scale,
        "rounds": args.rounds,
        "summary_workload": table,
        "summary": summary,
        "served": served,
        "offline": offline,
        "pair": pair,
        "ratios": ratios(summary, offline, pair),
        "logs": str(logs),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    path = args.out / ("vs_vllm.json" if args.model == "default" else f"vs_vllm-{args.model}.json")
    path.write_text(json.dumps(result, indent=2, default=str))  # before plotting: kept whatever
    print(json.dumps(result["ratios"], indent=2))
    result["plot"] = plot(result, args.out)
    path.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
