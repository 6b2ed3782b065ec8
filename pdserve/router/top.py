"""`pdserve top --router URL`: the fleet behind a router in a terminal, refreshed every few
seconds. Per node: its role, whether the router routes to it, the requests it holds (running
and waiting), its KV cache use, its prefix-cache hit rate and the KV bytes per second it moved
since the last refresh; and the router's routing audit (predicted prefix hits realized).
Decodes are read from their own /metrics; prefill nodes, which serve no HTTP, as the router
sees them over gRPC (health, requests, KV use, cached blocks).

Lifecycle: a `Top` keeps the previous sample of each node's transferred bytes, so every
`sample` after the first has rates; `render` makes a sample a screen of text.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text page, by (name, labels)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sum of `name`'s samples carrying `labels` (None: there is none)."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    return sum(found) if found else None


@dataclass
class NodeRow:
    name: str
    role: str  # decode or prefill
    routed: bool  # the router sends it requests
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # share of its KV cache in use
    hit_rate: float | None = None  # prompt tokens served from its prefix cache / prompt tokens
    transfer_bytes: float | None = None  # KV bytes moved so far (received or sent)
    gb_per_s: float | None = None  # since the last sample
    error: str = ""


@dataclass
class FleetView:
    router: str
    at: float
    rows: list[NodeRow] = field(default_factory=list)
    realization: float | None = None  # the router's audit: realized / predicted prefix hits
    requests_routed: float = 0.0


class Top:
    def __init__(self, router: str, api_key: str | None = None, timeout_s: float = 5.0) -> None:
        self.router = router.rstrip("/")
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout_s, headers=headers)
        self._last: dict[str, tuple[float, float]] = {}  # node -> (when, bytes moved)

    def sample(self) -> FleetView:
        router = parse_metrics(self.client.get(f"{self.router}/metrics").text)
        view = FleetView(self.router, time.time())
        view.realization = value(router, "pdserve:router_hit_realization")
        view.requests_routed = value(router, "pdserve:router_requests_total") or 0.0
        nodes = sorted(dict(ls)["node"] for n, ls in router if n == "pdserve:router_node_healthy")
        for name in nodes:
            routed = value(router, "pdserve:router_node_healthy", node=name) == 1
            if "://" in name:
                row = self._decode(name, routed)
            else:
                row = NodeRow(name, "prefill", routed)
                row.waiting = value(router, "pdserve:router_node_requests", node=name)
                row.kv_usage = value(router, "pdserve:router_prefill_kv_usage", prefill=name)
            view.rows.append(row)
        return view

    def _decode(self, name: str, routed: bool) -> NodeRow:
        row = NodeRow(name, "decode", routed)
        try:
            text = self.client.get(f"{name}/metrics").text
            samples = parse_metrics(text)
        except (httpx.HTTPError, ValueError) as e:
            row.error = type(e).__name__
            return row
        row.running = value(samples, "vllm:num_requests_running")
        row.waiting = value(samples, "vllm:num_requests_waiting")
        row.kv_usage = value(samples, "vllm:kv_cache_usage_perc")
        row.hit_rate = value(samples, "pdserve:prefix_cache_hit_rate")
        row.transfer_bytes = value(samples, "pdserve:transfer_bytes_total")
        now = time.monotonic()
        last = self._last.get(name)
        if row.transfer_bytes is not None:
            if last is not None and now > last[0]:
                row.gb_per_s = (row.transfer_bytes - last[1]) / (now - last[0]) / 1e9
            self._last[name] = (now, row.transfer_bytes)
        return row

    def close(self) -> None:
        self.client.close()


def _cell(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def render(view: FleetView) -> str:
    """A sample as a screen of text."""
    when = time.strftime("%H:%M:%S", time.localtime(view.at))
    audit = "-" if view.realization is None else f"{100 * view.realization:.0f}%"
    lines = [
        f"pdserve top  {view.router}  {when}  routed {view.requests_routed:.0f}  "
        f"prefix hits realized {audit}",
        "",
        f"{'NODE':<32} {'ROLE':<8} {'ROUTED':<6} {'RUN':>5} {'WAIT':>5} {'KV':>6} "
        f"{'HIT':>6} {'KV GB/s':>8}",
    ]
    for r in view.rows:
        kv = "-" if r.kv_usage is None else f"{100 * r.kv_usage:.0f}%"
        hit = "-" if r.hit_rate is None else f"{100 * r.hit_rate:.0f}%"
        lines.append(
            f"{r.name[:32]:<32} {r.role:<8} {'yes' if r.routed else 'NO':<6} "
            f"{_cell(r.running, '.0f'):>5} {_cell(r.waiting, '.0f'):>5} {kv:>6} {hit:>6} "
            f"{_cell(r.gb_per_s, '.3f'):>8}" + (f"  ({r.error})" if r.error else "")
        )
    return "\n".join(lines)


def run_top(router: str, api_key: str | None, interval_s: float, once: bool) -> int:
    top = Top(router, api_key)
    try:
        while True:
            try:
                screen = render(top.sample())
            except httpx.HTTPError as e:
                screen = f"pdserve top: cannot read {router}/metrics: {e}"
                if once:  # a script asked for one screen and got none: say so, exit 2
                    print(screen, file=sys.stderr)
                    return 2
            if once:
                print(screen)
                return 0
            print("\x1b[H\x1b[2J" + screen, flush=True)  # home, clear: one screen, redrawn
            time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0
    finally:
        top.close()
