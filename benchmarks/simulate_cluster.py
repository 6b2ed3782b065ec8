"""The router's real policies (`pdserve.router.policy`) against simulated prefill and decode
nodes in virtual time: 64 prefill x 64 decode by default, a multi-turn chat workload.

Workload (seeded, synthetic, Mooncake-trace-like): conversations start as a Poisson process;
each opens with one of a few shared system prompts and runs several turns; a turn's prompt is
the system prompt plus the whole history (every earlier user message and answer) plus a new
user message, so prompts share long prefixes within a conversation and across conversations
with the same system prompt. The next turn arrives a think time after the answer ends.

Nodes: a prefill node computes one prompt at a time (FIFO), only the part its own prefix cache
does not hold; KV moves to decode layer by layer while prefill computes, so the exposed part
is one layer's transfer; only blocks the decode does not hold move. A decode node runs a
continuous batch whose step time grows with the batch. Every node's prefix cache is an LRU of
16-token blocks (chained hashes of 64-character chunks, as the router names them) with the
capacity of pdserve's default KV budget. The router sees what a real router sees: its own
requests in flight per node; the nodes' caches are the ground truth it never reads.

Costs are pdserve's own measured figures where the results exist (benchmarks/results:
offline_throughput.json for prefill tokens/s and decode step times at batch 1 and 8,
transfer.json for TCP GB/s at 2048 tokens), else the defaults below.

Reported per policy: prefix-cache hit rate on prefill and on decode, bytes moved, TTFT p50/p99,
ITL p99, goodput under the SLO, the busiest node's work over the mean per pool, and the
busiest prefill node's load (requests in flight, averaged over time) over the mean.

    .venv/bin/python benchmarks/simulate_cluster.py [--prefill 64] [--decode 64] [--seed 0]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.router.policy import CHUNK_CHARS, POLICIES, Node, Policy, prefix_chain

RESULTS = Path("benchmarks/results")
CHARS_PER_TOKEN = 4  # CHUNK_CHARS (64) characters ~ one 16-token block
BLOCK_TOKENS = CHUNK_CHARS // CHARS_PER_TOKEN
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2  # SmolLM2-135M bf16: layers x K/V x heads x dim x 2
LAYERS = 30
CACHE_TOKENS = 1024 * 1024**2 // KV_BYTES_PER_TOKEN  # pdserve's default 1 GiB KV budget
MAX_BATCH = 64
WORDS = [f"w{i}" for i in range(5000)]


@dataclass
class Costs:
    prefill_tok_s: float = 1700.0
    step_b1_s: float = 0.044
    step_b8_s: float = 0.049
    transfer_Bps: float = 2.3e9
    source: str = "defaults"

    def step_s(self, batch: int) -> float:
        slope = (self.step_b8_s - self.step_b1_s) / 7
        return self.step_b1_s + slope * (max(batch, 1) - 1)


def measured_costs() -> Costs:
    costs, used = Costs(), []
    offline = RESULTS / "offline_throughput.json"
    if offline.exists():
        d = json.loads(offline.read_text())
        costs.prefill_tok_s = d["prefill_512_tokens_per_s"]["pdserve"]
        costs.step_b1_s = 1 / d["decode_batch1_tokens_per_s"]["pdserve"]
        costs.step_b8_s = 8 / d["decode_batch8_total_tokens_per_s"]["pdserve"]
        used.append(str(offline))
    transfer = RESULTS / "transfer.json"
    if transfer.exists():
        d = json.loads(transfer.read_text())["results"]["2048_tokens_consecutive_blocks"]
        costs.transfer_Bps = d["pdserve_tcp_GBps"] * 1e9
        used.append(str(transfer))
    costs.source = ", ".join(used) or "defaults"
    return costs


class BlockCache:
    """A node's prefix cache: an LRU of chained block hashes."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def matched(self, chain: list[bytes]) -> int:
        n = 0
        for h in chain:
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            n += 1
        return n

    def store(self, chain: list[bytes]) -> None:
        for h in chain:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


@dataclass
class Request:
    conv: int
    turn: int
    text: str
    output_tokens: int
    arrival: float
    chain: list[bytes] = field(default_factory=list)
    prefill_cached: int = 0
    decode_cached: int = 0
    first_token: float = 0.0
    done: float = 0.0
    max_itl: float = 0.0
    itl_sum: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return len(self.text) // CHARS_PER_TOKEN


@dataclass
class Conversation:
    system: str
    turns: int
    history: str = ""
    turn: int = 0


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + " "


def make_workload(args: argparse.Namespace) -> tuple[list[Conversation], list[float]]:
    rng = random.Random(args.seed)
    systems = [words(rng, args.system_words) for _ in range(args.system_prompts)]
    convs, starts, t = [], [], 0.0
    for _ in range(args.conversations):
        t += rng.expovariate(args.rate)
        # A few popular system prompts (Zipf-like), as in production traces.
        system = systems[min(int(rng.paretovariate(1.2)) - 1, len(systems) - 1)]
        convs.append(Conversation(system, rng.randint(args.min_turns, args.max_turns)))
        starts.append(t)
    return convs, starts


class Sim:
    def __init__(self, args: argparse.Namespace, policy: str, costs: Costs) -> None:
        self.args, self.costs = args, costs
        self.rng = random.Random(args.seed + 1)
        self.policy_p, self.policy_d = Policy(policy), Policy(policy)
        self.pnodes = [Node(f"p{i}") for i in range(args.prefill)]
        self.dnodes = [Node(f"d{i}") for i in range(args.decode)]
        blocks = CACHE_TOKENS // BLOCK_TOKENS
        self.pcache = [BlockCache(blocks) for _ in self.pnodes]
        self.dcache = [BlockCache(blocks) for _ in self.dnodes]
        self.pfree = [0.0] * args.prefill  # when each prefill node is next idle
        self.pload_area = [0.0] * args.prefill  # integral of in-flight requests over time
        self.pload_at = [0.0] * args.prefill
        self.pbusy = [0.0] * args.prefill
        # decode: per node the running batch {request: remaining tokens}, epoch start
        self.batch: list[dict[int, float]] = [{} for _ in self.dnodes]
        self.epoch = [0.0] * args.decode
        self.version = [0] * args.decode  # a decode event of an older version is stale
        self.dwork = [0.0] * args.decode  # token-steps served
        self.reqs: list[Request] = []
        self.where: dict[int, tuple[int, int]] = {}
        self.events: list[tuple[float, int, str, int, int]] = []
        self.seq = 0
        self.bytes_moved = 0
        self.itl_samples: list[tuple[float, float]] = []  # (step time, tokens at it)

    def push(self, t: float, kind: str, idx: int, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, idx, version))

    def run(self) -> dict[str, Any]:
        convs, starts = make_workload(self.args)
        self.convs = convs
        for i, t in enumerate(starts):
            self.push(t, "turn", i)
        while self.events:
            t, _, kind, idx, version = heapq.heappop(self.events)
            if kind == "turn":
                self.arrive(t, idx)
            elif kind == "joined":
                self.join(t, idx)
            elif version == self.version[idx]:  # the node's next finish, still current
                self.settle(t, idx)
        return self.report()

    def arrive(self, t: float, conv_i: int) -> None:
        conv = self.convs[conv_i]
        text = conv.system + conv.history + words(self.rng, self.rng.randint(20, 120))
        req = Request(conv_i, conv.turn, text, self.rng.randint(32, 256), t)
        req.chain = prefix_chain(text)
        self.reqs.append(req)
        ri = len(self.reqs) - 1
        d = self.policy_d.pick(self.dnodes, req.chain, now=t)
        p = self.policy_p.pick(self.pnodes, req.chain, now=t)
        di, pi = self.dnodes.index(d), self.pnodes.index(p)
        d.in_flight += 1
        self.account(pi, t)
        p.in_flight += 1
        self.where[ri] = (pi, di)
        # Prefill: FIFO on the node, only what its cache lacks.
        cached_p = self.pcache[pi].matched(req.chain) * BLOCK_TOKENS
        req.prefill_cached = min(cached_p, req.prompt_tokens - 1)
        compute = (req.prompt_tokens - req.prefill_cached) / self.costs.prefill_tok_s
        start = max(t, self.pfree[pi])
        self.pfree[pi] = start + compute
        self.pbusy[pi] += compute
        self.pcache[pi].store(req.chain)
        # Transfer: the blocks decode lacks, overlapped with compute except the last layer.
        req.decode_cached = min(
            self.dcache[di].matched(req.chain) * BLOCK_TOKENS, req.prompt_tokens
        )
        moved = (req.prompt_tokens - req.decode_cached) * KV_BYTES_PER_TOKEN
        self.bytes_moved += moved
        exposed = moved / self.costs.transfer_Bps / LAYERS
        self.push(start + compute + exposed, "joined", ri)

    def join(self, t: float, ri: int) -> None:
        req = self.reqs[ri]
        pi, di = self.where[ri]
        self.account(pi, t)
        self.pnodes[pi].in_flight -= 1
        req.first_token = t
        self.settle(t, di, reschedule=False)
        self.batch[di][ri] = req.output_tokens - 1  # the first token came from prefill
        self.reschedule(t, di)

    def account(self, pi: int, t: float) -> None:
        self.pload_area[pi] += self.pnodes[pi].in_flight * (t - self.pload_at[pi])
        self.pload_at[pi] = t

    def settle(self, t: float, di: int, reschedule: bool = True) -> None:
        """Advance node `di`'s batch to `t`, finish what is done."""
        batch = self.batch[di]
        if batch:
            step = self.costs.step_s(min(len(batch), MAX_BATCH))
            tokens = (t - self.epoch[di]) / step
            self.itl_samples.append((step, tokens * len(batch)))
            self.dwork[di] += tokens * len(batch)
            for ri in list(batch):
                req = self.reqs[ri]
                req.max_itl = max(req.max_itl, step)
                req.itl_sum += step * min(tokens, batch[ri])
                batch[ri] -= tokens
                if batch[ri] <= 1e-9:
                    del batch[ri]
                    self.finish(t, ri, di)
        self.epoch[di] = t
        if reschedule:
            self.reschedule(t, di)

    def reschedule(self, t: float, di: int) -> None:
        self.version[di] += 1
        batch = self.batch[di]
        if batch:
            step = self.costs.step_s(min(len(batch), MAX_BATCH))
            self.push(t + min(batch.values()) * step, "decode", di, self.version[di])

    def finish(self, t: float, ri: int, di: int) -> None:
        req = self.reqs[ri]
        req.done = t
        self.dnodes[di].in_flight -= 1
        answer = words(self.rng, req.output_tokens * CHARS_PER_TOKEN // 5)
        self.dcache[di].store(prefix_chain(req.text + answer))
        conv = self.convs[req.conv]
        conv.history = req.text[len(conv.system) :] + answer
        conv.turn += 1
        if conv.turn < conv.turns:
            self.push(t + self.rng.expovariate(1 / self.args.think_s), "turn", req.conv)

    def report(self) -> dict[str, Any]:
        reqs = [r for r in self.reqs if r.done > 0]
        ttft = sorted(r.first_token - r.arrival for r in reqs)
        prompt = sum(r.prompt_tokens for r in reqs)
        slo = self.args
        good = [
            r
            for r in reqs
            if r.first_token - r.arrival <= slo.slo_ttft_s
            and r.itl_sum / max(r.output_tokens - 1, 1) <= slo.slo_itl_s
        ]
        span = max(r.done for r in reqs) - min(r.arrival for r in reqs)
        self.itl_samples.sort()
        total = sum(w for _, w in self.itl_samples)
        acc, itl_p99 = 0.0, 0.0
        for step, w in self.itl_samples:
            acc += w
            if acc >= 0.99 * total:
                itl_p99 = step
                break

        def imbalance(work: list[float]) -> float:
            mean = sum(work) / len(work)
            return max(work) / mean if mean else 0.0

        return {
            "requests": len(reqs),
            "prefill_prefix_hit_rate": sum(r.prefill_cached for r in reqs) / prompt,
            "decode_prefix_hit_rate": sum(r.decode_cached for r in reqs) / prompt,
            "bytes_moved": self.bytes_moved,
            "ttft_p50_s": ttft[len(ttft) // 2],
            "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "itl_p99_s": itl_p99,
            "goodput_req_s": len(good) / span,
            "slo_attainment": len(good) / len(reqs),
            "prefill_work_max_over_mean": imbalance(self.pbusy),
            "prefill_load_max_over_mean": imbalance(self.pload_area),
            "decode_work_max_over_mean": imbalance(self.dwork),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=3000)
    ap.add_argument("--rate", type=float, default=24.0, help="conversations started per second")
    ap.add_argument("--min-turns", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--think-s", type=float, default=8.0)
    ap.add_argument("--system-prompts", type=int, default=200)
    ap.add_argument("--system-words", type=int, default=300, help="~400 tokens")
    ap.add_argument("--slo-ttft-s", type=float, default=2.0)
    ap.add_argument("--slo-itl-s", type=float, default=0.1)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "simulate_cluster.json"))
    args = ap.parse_args()
    costs = measured_costs()
    results: dict[str, Any] = {}
    for name in args.policies.split(","):
        started = time.perf_counter()
        results[name] = Sim(args, name, costs).run()
        results[name]["wall_s"] = time.perf_counter() - started
        print(name, json.dumps(results[name]), flush=True)
    out: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "costs": vars(costs),
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        "cache_tokens_per_node": CACHE_TOKENS,
        "policies": results,
    }
    if "cache_aware" in results and "round_robin" in results:
        ca, rr = results["cache_aware"], results["round_robin"]
        out["cache_aware_vs_round_robin"] = {
            "prefill_hit_rate_ratio": ca["prefill_prefix_hit_rate"]
            / max(rr["prefill_prefix_hit_rate"], 1e-9),
            "decode_hit_rate_ratio": ca["decode_prefix_hit_rate"]
            / max(rr["decode_prefix_hit_rate"], 1e-9),
            "ttft_p99_ratio": ca["ttft_p99_s"] / rr["ttft_p99_s"],
            "bytes_moved_ratio": ca["bytes_moved"] / rr["bytes_moved"],
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out.get("cache_aware_vs_round_robin", {}), indent=2))
    plot(out, Path(args.out).with_suffix(".png"))


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["policies"])
    panels = [
        ("prefill_prefix_hit_rate", "prefill prefix hit rate"),
        ("decode_prefix_hit_rate", "decode prefix hit rate"),
        ("ttft_p99_s", "TTFT p99 (s)"),
        ("goodput_req_s", "goodput (req/s within SLO)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.bar(names, [out["policies"][n][key] for n in names], color=["#888", "#59c", "#d73"])
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(
        f"router policies, {out['config']['prefill']} prefill x {out['config']['decode']} decode "
        "(simulated)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
