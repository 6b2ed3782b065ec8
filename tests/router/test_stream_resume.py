"""Streams moving between decodes behind `pdserve router` (2 prefill and 2 decode nodes, real
processes on loopback, a tiny random model): a decode SIGKILLed under concurrent streams, or
drained by `pdserve drain`, costs none — every stream completes on the other decode, its text
identical to the same stream undisturbed, without a gap or a repeat, one stream id throughout
(after a kill, going on within 2 s)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import logs_kept_on_failure, make_tiny_model
from tests.router.test_router_e2e import MODEL, Cluster

pytestmark = pytest.mark.slow

STREAMS = 4
MAX_TOKENS = 160
KILLED = 1000  # tokens of a stream that must outlast the others' start on a busy host (~1 s)
LONG = 3000  # tokens of a stream that must outlast `pdserve drain`'s start (no torch: ~0.1 s idle)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A long context: streams long enough to outlast the start of the `pdserve drain` command.
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=LONG + 64)


@pytest.fixture
def cluster(model: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(model, "round_robin")
    with logs_kept_on_failure(request, lambda: [p.log for p in c.procs]):
        try:
            yield c
        finally:
            c.stop()


class Stream:
    """One streamed completion read on its own thread: its events with their arrival times."""

    def __init__(
        self, router: str, prompt: list[int], seeded: bool, max_tokens: int, salt: str | None
    ) -> None:
        self.body: dict[str, Any] = {
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0,
        }  # fmt: skip
        if salt is not None:
            self.body["cache_salt"] = salt
        if seeded:
            self.body.update(temperature=0.9, seed=7)
        self.url = f"{router}/v1/completions"
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.done = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        body = json.loads(line.removeprefix("data: "))
                        self.events.append((time.monotonic(), body))
        except BaseException as e:  # reported by the test
            self.error = e

    def join(self) -> None:
        self.thread.join(120)
        assert self.error is None, self.error
        assert self.done, "no [DONE]"

    @property
    def text(self) -> str:
        return "".join(b["choices"][0]["text"] for _, b in self.events if b.get("choices"))


def run(
    cluster: Cluster,
    prompts: list[list[int]],
    kill: Any = None,
    max_tokens: int = MAX_TOKENS,
    salt: str | None = None,
) -> list[Stream]:
    """`prompts` streamed through the router (`kill` called once every stream is under way);
    `salt`: their cache salt (their KV shared with no request of another salt)."""
    streams = [
        Stream(cluster.router, p, i % 2 == 1, max_tokens, salt) for i, p in enumerate(prompts)
    ]
    if kill is not None:
        deadline = time.monotonic() + 60
        while min(len(s.events) for s in streams) < 3:  # every stream under way
            assert time.monotonic() < deadline and not any(s.error for s in streams)
            time.sleep(0.002)
        # A stream already over when `kill` runs would not be disturbed by it at all.
        assert not any(s.done for s in streams), "a stream ended before the others began"
        kill()
    for s in streams:
        s.join()
    return streams


def disrupted(
    cluster: Cluster, prompts: list[list[int]], signum: int, max_tokens: int
) -> tuple[list[Stream], float]:
    """`prompts` streamed through the router, the first decode sent `signum` while they run:
    the streams (checked to equal the undisturbed run, each one stream, every stream the
    decode had moved) and when the signal went."""
    undisturbed = [s.text for s in run(cluster, prompts, max_tokens=max_tokens)]
    assert all(len(t.split()) > MAX_TOKENS // 2 for t in undisturbed)  # about a word a token
    routed = "pdserve:router_requests_total"
    victim_url = cluster.decodes[0]
    before = cluster.metric(cluster.router, routed, {"decode": victim_url})
    victim = next(p for p in cluster.procs if "decode" in p.log.name)
    at: list[float] = []

    def disrupt() -> None:
        victim.signal(signum)
        at.append(time.monotonic())

    try:
        streams = run(cluster, prompts, disrupt, max_tokens)
    finally:
        victim.signal(signal.SIGCONT)  # a stopped one goes on (its requests long aborted)
    on_victim = cluster.metric(cluster.router, routed, {"decode": victim_url}) - before
    assert on_victim >= 1  # round robin: half of them were on that decode
    assert [s.text for s in streams] == undisturbed
    for s in streams:
        assert not [b for _, b in s.events if "error" in b]
        assert len({b["id"] for _, b in s.events}) == 1  # one stream, as the client sees it
    resumed = "pdserve:router_resumed_streams_total"
    assert cluster.metric(cluster.router, resumed) == on_victim
    return streams, at[0]


def longest_gap_across(streams: list[Stream], at: float) -> float:
    """The longest silence a client saw across `at` (the first gap ending after it)."""
    gaps = []
    for s in streams:
        times = [t for t, _ in s.events]
        gaps += [b - a for a, b in zip(times, times[1:], strict=False) if b >= at][:1]
    return max(gaps, default=0.0)


def test_a_killed_decode_costs_no_stream(cluster: Cluster) -> None:
    prompts = [[3 + (5 * i + 3 * j) % 250 for j in range(24 + 8 * i)] for i in range(STREAMS)]
    streams, killed_at = disrupted(cluster, prompts, signal.SIGKILL, KILLED)
    assert longest_gap_across(streams, killed_at) < 2.0  # resumed within 2 s of the kill


@pytest.mark.parametrize("how", ["live", "recompute"])
def test_drain_moves_a_decodes_streams_and_it_stops_holding_nothing(
    cluster: Cluster, how: str
) -> None:
    """`pdserve drain` under 4 streams: the drained decode's streams go on from the other one,
    texts as undisturbed; no new request goes there; it then holds no block and exits 0 on
    SIGTERM. `--undo` puts a decode back in rotation. Live (the default): the drained decode
    pauses each stream and the other fetches its KV over the transfer plane (counted on both
    sides, bytes received) instead of computing it; `--recompute`: the other computes it."""
    prompts = [[3 + (11 * i + 5 * j) % 250 for j in range(20 + 6 * i)] for i in range(STREAMS)]
    # Salted apart: a stream the other decode served here would be cached there whole, and one
    # moved there later would go on from its cache with nothing to fetch (migration_cached).
    undisturbed = [s.text for s in run(cluster, prompts, max_tokens=LONG, salt=f"alone-{how}")]
    drained, other = cluster.decodes
    routed = "pdserve:router_requests_total"
    before = cluster.metric(cluster.router, routed, {"decode": drained})
    received = "pdserve:transfer_bytes_total"
    received_before: list[float] = []  # once every stream is under way (prefilled)
    answers: list[dict[str, Any]] = []

    def drain() -> None:
        received_before.append(cluster.metric(other, received, {"direction": "received"}))
        cmd = [sys.executable, "-m", "pdserve.cli", "drain", "--router", cluster.router,
               "--decode", drained, "--timeout", "30"]  # fmt: skip
        if how == "recompute":
            cmd.append("--recompute")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        answers.append(json.loads(done.stdout))

    streams = run(cluster, prompts, drain, LONG)
    on_drained = cluster.metric(cluster.router, routed, {"decode": drained}) - before
    assert on_drained >= 1 and answers[0]["moved"] == on_drained and answers[0]["drained"]
    assert [s.text for s in streams] == undisturbed
    live = on_drained if how == "live" else 0
    assert answers[0]["migrated"] == live
    assert cluster.metric(cluster.router, "pdserve:router_migrated_streams_total") == live
    resumed = cluster.metric(cluster.router, "pdserve:router_resumed_streams_total")
    assert resumed == on_drained - live
    migrations = "pdserve:migrations_total"
    assert cluster.metric(drained, migrations, {"event": "out"}) == live
    assert cluster.metric(other, migrations, {"event": "in"}) == live
    assert cluster.metric(other, migrations, {"event": "failed"}) == 0
    # Live, the drained streams' KV crossed after the drain; recomputed, nothing did.
    moved = cluster.metric(other, received, {"direction": "received"}) - received_before[0]
    assert (moved > 0) == (how == "live")
    assert all(len({b["id"] for _, b in s.events}) == 1 for s in streams)
    assert cluster.http.get(f"{cluster.router}/health").json()["draining"] == [drained]
    for p in prompts:  # none goes to the drained decode now
        cluster.complete(p, 4)
    assert cluster.metric(cluster.router, routed, {"decode": drained}) - before == on_drained
    assert cluster.metric(drained, "vllm:num_requests_running") == 0
    assert cluster.metric(drained, "vllm:kv_cache_usage_perc") == 0.0
    # Back in rotation: it takes requests again.
    undo = [sys.executable, "-m", "pdserve.cli", "drain", "--router", cluster.router,
            "--decode", drained, "--undo"]  # fmt: skip
    assert subprocess.run(undo, capture_output=True, timeout=60).returncode == 0
    for p in prompts[:2]:
        cluster.complete(p, 4)
    assert cluster.metric(cluster.router, routed, {"decode": drained}) - before > on_drained
    decode = next(p for p in cluster.procs if "decode" in p.log.name)
    decode.stop(signal.SIGTERM)
    assert decode.proc.returncode == 0
    assert other in cluster.decodes


def test_a_frozen_decode_costs_no_stream(cluster: Cluster) -> None:
    """A decode that stops answering without closing its connections (SIGSTOP: a host gone
    silent): once the health probes find it dead, its silent streams go on from the other
    decode, texts as undisturbed — not at their deadline."""
    prompts = [[3 + (13 * i + 7 * j) % 250 for j in range(22 + 5 * i)] for i in range(STREAMS)]
    streams, frozen_at = disrupted(cluster, prompts, signal.SIGSTOP, LONG)
    # A probe's timeout (1 s) and poll (0.5 s), then the move: seconds, not the deadline.
    assert longest_gap_across(streams, frozen_at) < 5.0
