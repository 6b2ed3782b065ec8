"""The router's watch over its decodes: every `poll_s` each decode's /health and /metrics
(waiting + running requests: its load) and, where the router indexes prompts, its KV events,
over a small connection pool of its own, so that a forwarding pool full of streams never
delays a probe. A decode that fails a probe, or refuses a connection, is marked unhealthy (the
policies skip it) until it answers again; when it comes back, what it cached may be gone."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from pdserve.config import RouterConfig
from pdserve.router.policy import Node
from pdserve.router.prompts import KVView

logger = logging.getLogger(__name__)

LOAD_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running")  # vLLM reads alike
PROBE_CONNECTIONS_PER_DECODE = 2


def reported_load(text: str) -> int:
    """Waiting + running requests in a decode's Prometheus text."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in LOAD_GAUGES:
                total += sample.value
    return int(total)


@dataclass(frozen=True)
class NodeAccess:
    """How the router reaches its nodes: their API key (as headers) and TLS verification."""

    headers: dict[str, str]
    verify: ssl.SSLContext | bool


class DecodeMonitor:
    """Probes `decodes` and keeps their `healthy`/`reported` fields and `kv_views` current;
    `on_back(node)` is called when a decode answers again after failing."""

    def __init__(
        self,
        config: RouterConfig,
        decodes: list[Node],
        kv_views: dict[str, KVView] | None,
        access: NodeAccess,
        registry: CollectorRegistry,
        on_back: Callable[[Node], None],
    ) -> None:
        self.config = config
        self.decodes = decodes
        self.kv_views = kv_views  # None: the router does not index prompts, nothing to follow
        self.headers = access.headers  # the decodes' API key, for /metrics and /kv_events
        self.on_back = on_back
        self.probes = httpx.AsyncClient(
            timeout=config.probe_timeout_s,
            limits=httpx.Limits(max_connections=PROBE_CONNECTIONS_PER_DECODE * len(decodes)),
            verify=access.verify,
        )
        self.kv_blocks = Gauge(
            "pdserve:router_kv_blocks",
            "Prefix-cache blocks each decode reported holding (its KV events, followed)",
            ["decode"],
            registry=registry,
        )
        self.healthy = Gauge(
            "pdserve:router_node_healthy", "1 if the router sends requests to the node",
            ["node"], registry=registry,
        )  # fmt: skip
        self._poll: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """One probe of every decode now, then one every `poll_s` until stop()."""
        await self.poll_once()
        self._poll = asyncio.create_task(self._poll_loop())

    async def stop(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll
        await self.probes.aclose()

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_s)
            await self.poll_once()

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._probe(n) for n in self.decodes))

    async def _probe(self, node: Node) -> None:
        timeout = self.config.probe_timeout_s
        try:
            health = await self.probes.get(f"{node.name}/health", timeout=timeout)
            metrics = await self.probes.get(
                f"{node.name}/metrics", headers=self.headers, timeout=timeout
            )
            ok = health.status_code == 200 and metrics.status_code == 200
            reported = reported_load(metrics.text) if ok else 0
            if ok and self.kv_views is not None:
                await self._follow_kv(node, self.kv_views[node.name])
        except (httpx.HTTPError, ValueError, KeyError) as e:
            logger.debug("decode %s probe failed: %s", node.name, e)
            ok, reported = False, 0
        self.set_health(node, ok)
        node.reported = reported

    async def _follow_kv(self, node: Node, view: KVView) -> None:
        """Apply the decode's prefix-cache changes since the last poll (all of it after a
        restart: a new epoch resets the view)."""
        params: dict[str, Any] = {"since": view.seq}
        if view.epoch is not None:
            params["epoch"] = view.epoch
        r = await self.probes.get(
            f"{node.name}/kv_events",
            params=params,
            headers=self.headers,
            timeout=self.config.probe_timeout_s,
        )
        if r.status_code == 200:
            view.apply(r.json())
            self.kv_blocks.labels(node.name).set(len(view.keys))

    def set_health(self, node: Node, ok: bool) -> None:
        if ok != node.healthy:
            logger.warning("decode %s is %s", node.name, "back" if ok else "unavailable")
            if ok:  # it restarted, or came back: what it cached may be gone
                self.on_back(node)
        node.healthy = ok
        self.healthy.labels(node.name).set(1 if ok else 0)
