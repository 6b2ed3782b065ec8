"""Live migration of decoding streams: what a client sees when a decode is drained mid-stream,
its streams moved with their KV (live) or computed again on the other decode (recompute).

One prefill and 2 decode nodes behind `pdserve router` (round robin), the bundled model, one
thread per node, all on loopback. Per dtype (fp32; bf16 with `--deterministic`) and round: 8
greedy streams of `--tokens` tokens (prompts of 96-160 tokens), started one after another
(each one's decode read from the router's counters), so 4 run on each decode; then
  undisturbed  nothing happens;
  live         once every stream has `--at` tokens, decode 0 is drained (`POST /admin/drain`):
               it pauses its 4 streams and decode 1 fetches their KV and goes on;
  recompute    the same drain with `migrate: false`: decode 1 computes prompt + tokens again.
Each drain is undone before the next run; the order of the three turns each round. Checked and
written as JSON (before anything else can fail): every moved run's 8 texts equal the round's
undisturbed ones; each moved stream's pause (the gap a client saw across the drain) against
2 decode steps (the median gap of decode 1's streams after the move) + 50 ms.

    .venv/bin/python benchmarks/migration.py [--rounds 3] [--tokens 200] [--at 60]
        [--out benchmarks/results/migration.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.model.isa import host_description

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drain import Proc  # noqa: E402  (a sibling script)
from soak import free_port  # noqa: E402

MODEL = "smollm2"
STREAMS = 8
MODES = ("undisturbed", "live", "recompute")
DTYPES = {"fp32": ["--dtype", "float32"], "bf16": ["--dtype", "bfloat16", "--deterministic"]}


class Fleet:
    def __init__(self, dtype_args: list[str]) -> None:
        self.procs: list[Proc] = []
        common = [*dtype_args, "--threads", "1"]
        prefill = f"127.0.0.1:{free_port()}"
        self.decodes = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        self.router = f"http://127.0.0.1:{free_port()}"
        self.procs.append(Proc(["prefill", *common, "--port", prefill.rsplit(":", 1)[1]], "p"))
        for i, url in enumerate(self.decodes):
            args = ["serve", "--role", "decode", *common, "--port", url.rsplit(":", 1)[1]]
            args += ["--grpc-port", "0", "--transfer-port", "0", "--prefill", prefill]
            args += ["--min-prefill-tokens", "1", "--served-model-name", MODEL]
            self.procs.append(Proc(args, f"decode{i}"))
        for p in self.procs:
            p.wait_for("ready")
        decodes = [a for u in self.decodes for a in ("--decode", u)]
        router = ["router", *decodes, "--prefill", prefill, "--policy", "round_robin"]
        self.procs.append(Proc([*router, "--port", self.router.rsplit(":", 1)[1]], "router"))
        self.procs[-1].wait_for("router ready")
        self.http = httpx.Client(timeout=120)

    def routed(self) -> dict[str, float]:
        """Requests the router sent each decode so far."""
        counts = dict.fromkeys(self.decodes, 0.0)
        for line in self.http.get(f"{self.router}/metrics").text.splitlines():
            if line.startswith("pdserve:router_requests_total{"):
                for url in counts:
                    if f'decode="{url}"' in line:
                        counts[url] += float(line.rsplit(" ", 1)[1])
        return counts

    def drain(self, migrate: bool, undo: bool = False) -> dict[str, Any]:
        body = {"decode": self.decodes[0], "migrate": migrate, "undo": undo, "timeout_s": 60}
        r = self.http.post(f"{self.router}/admin/drain", json=body)
        r.raise_for_status()
        answer: dict[str, Any] = r.json()
        return answer

    def stop(self) -> None:
        self.http.close()
        for p in self.procs:
            p.stop()


class Stream:
    """One streamed completion read on its own thread: arrival time of each text event."""

    def __init__(self, url: str, prompt: list[int], tokens: int) -> None:
        self.body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                     "ignore_eos": True, "stream": True}  # fmt: skip
        self.url = f"{url}/v1/completions"
        self.times: list[float] = []
        self.tokens = 0
        self.text = ""
        self.error: str | None = None
        self.done = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=300) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.error = str(event["error"])
                            return
                        self.text += event["choices"][0].get("text", "")
                        self.times.append(time.monotonic())
        except httpx.HTTPError as e:
            self.error = f"{type(e).__name__}: {e}"

    def gap_across(self, at: float) -> float:
        """The silence this stream's client saw across `at`."""
        for a, b in zip(self.times, self.times[1:], strict=False):
            if b >= at:
                return b - a
        return 0.0

    def gaps_after(self, at: float) -> list[float]:
        """Its gaps after the first one across `at`."""
        later = [t for t in self.times if t >= at]
        return [b - a for a, b in zip(later, later[1:], strict=False)]


def one_run(fleet: Fleet, prompts: list[list[int]], mode: str, args: argparse.Namespace) -> dict:
    streams: list[Stream] = []
    on_drained: list[bool] = []
    for prompt in prompts:  # one at a time: which decode each went to is known
        before = fleet.routed()
        streams.append(Stream(fleet.router, prompt, args.tokens))
        while not streams[-1].times and streams[-1].error is None:
            time.sleep(0.005)
        after = fleet.routed()
        on_drained.append(after[fleet.decodes[0]] > before[fleet.decodes[0]])
    drained_at, answer = None, None
    if mode != "undisturbed":
        while min(len(s.times) for s in streams) < args.at:
            time.sleep(0.005)
        drained_at = time.monotonic()
        answer = fleet.drain(migrate=mode == "live")
    for s in streams:
        s.thread.join(300)
    if answer is not None:
        fleet.drain(migrate=True, undo=True)
    run: dict[str, Any] = {
        "mode": mode,
        "texts": [s.text for s in streams],
        "errors": [s.error for s in streams if s.error or not s.done],
        "on_drained": on_drained,
        "drain": answer,
    }
    if drained_at is not None:
        moved = [s for s, d in zip(streams, on_drained, strict=True) if d]
        stayed = [s for s, d in zip(streams, on_drained, strict=True) if not d]
        run["pause_ms"] = [round(1000 * s.gap_across(drained_at), 1) for s in moved]
        run["stayed_gap_ms"] = [round(1000 * s.gap_across(drained_at), 1) for s in stayed]
        # Decode 1's step once every stream runs there: the median gap after the move.
        after = [g for s in streams for g in s.gaps_after(drained_at)[1:]]
        run["step_after_ms"] = round(1000 * statistics.median(after), 1)
    return run


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--at", type=int, default=60, help="tokens every stream has at the drain")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--out", default="benchmarks/results/migration.json")
    args = parser.parse_args()
    report: dict[str, Any] = {"host": host_description(), "args": vars(args), "runs": []}
    prompts = [[1000 + (37 * i + 11 * j) % 19000 for j in range(96 + 8 * i)] for i in range(8)]
    for dtype in args.dtypes.split(","):
        fleet = Fleet(DTYPES[dtype])
        try:
            for r in range(args.rounds):
                for mode in MODES[r % 3 :] + MODES[: r % 3]:
                    run = one_run(fleet, prompts, mode, args)
                    run.update(dtype=dtype, round=r)
                    report["runs"].append(run)
                    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
                    shown = {k: v for k, v in run.items() if k != "texts"}
                    print(json.dumps(shown), flush=True)
        finally:
            fleet.stop()
    summary: dict[str, Any] = {}
    for dtype in args.dtypes.split(","):
        runs = [x for x in report["runs"] if x["dtype"] == dtype]
        undisturbed = {x["round"]: x["texts"] for x in runs if x["mode"] == "undisturbed"}
        for mode in ("live", "recompute"):
            moved = [x for x in runs if x["mode"] == mode]
            pauses = [p for x in moved for p in x["pause_ms"]]
            bound = [2 * x["step_after_ms"] + 50 for x in moved]
            summary[f"{dtype}/{mode}"] = {
                "identical_texts": all(x["texts"] == undisturbed[x["round"]] for x in moved),
                "errors": sum(len(x["errors"]) for x in moved),
                "migrated": [x["drain"]["migrated"] for x in moved],
                "pause_ms": {
                    "p50": percentile(pauses, 50),
                    "p99": percentile(pauses, 99),
                    "max": max(pauses),
                },  # fmt: skip
                "bound_ms (2 steps + 50)": min(bound),
                "p99_within_bound": percentile(pauses, 99) <= min(bound),
            }
    report["summary"] = summary
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
