"""The router's watch over its nodes: every `poll_s` each decode's /health and /metrics
(waiting + running requests: its load) and, where the router indexes prompts, its KV events,
over a small connection pool of its own, so that a forwarding pool full of streams never
delays a probe; and each prefill node's the same over gRPC (`GetPeerInfo`, which a broken node
refuses, `GetStats`, `GetKVEvents`), with the cluster secret and the router's --tls-ca. A node
that fails a probe (refuses a connection, answers an error; or leaves two probes in a row
unanswered: one may just be a busy node) is marked unhealthy (the policies skip it) until it
answers again; when it comes back, what it cached may be gone. A prefill node that refuses the
router's credentials is not unhealthy (decodes still reach it): the router says, once, that it
cannot see it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from pdserve.config import RouterConfig
from pdserve.disagg.auth import channel_credentials, client_interceptors
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.disagg.wire import CHANNEL_OPTIONS
from pdserve.router.policy import Node
from pdserve.router.prompts import KVView

logger = logging.getLogger(__name__)

LOAD_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running")  # vLLM reads alike
PROBE_CONNECTIONS_PER_DECODE = 2
PROBE_TIMEOUTS_TO_FAIL = 2  # probes in a row without an answer that mark a node unhealthy


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


class NodeMonitor:
    """Probes `decodes` and `prefills` and keeps their `healthy`/`reported` fields and
    `kv_views` (by node name) current; `on_back(node)` is called when a node answers again
    after failing."""

    def __init__(
        self,
        config: RouterConfig,
        decodes: list[Node],
        kv_views: dict[str, KVView] | None,
        access: NodeAccess,
        registry: CollectorRegistry,
        on_back: Callable[[Node], None],
        prefills: list[Node] | None = None,
        on_gone: Callable[[str, set[bytes]], None] = lambda name, keys: None,
    ) -> None:
        self.config = config
        self.decodes = decodes
        self.prefills = prefills or []
        self.kv_views = kv_views  # None: the router does not index prompts, nothing to follow
        # Opened at the first probe (a gRPC channel belongs to the running event loop).
        self._stubs: dict[str, tuple[grpc.aio.Channel, Any]] = {}
        self._unauthorized: set[str] = set()  # prefill nodes the router cannot see (said once)
        self.headers = access.headers  # the decodes' API key, for /metrics and /kv_events
        self.on_back = on_back
        self.on_gone = on_gone  # a node's KV events said it no longer holds these keys
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
        self.prefill_kv_blocks = Gauge(
            "pdserve:router_prefill_kv_blocks",
            "Prefix-cache blocks each prefill node reported holding (its KV events, followed)",
            ["prefill"],
            registry=registry,
        )
        self.healthy = Gauge(
            "pdserve:router_node_healthy", "1 if the router sends requests to the node",
            ["node"], registry=registry,
        )  # fmt: skip
        self.requests = Gauge(
            "pdserve:router_node_requests",
            "Requests each node last reported holding (waiting and running)",
            ["node"], registry=registry,
        )  # fmt: skip
        self.prefill_kv_usage = Gauge(
            "pdserve:router_prefill_kv_usage",
            "Share of each prefill node's KV blocks in use, as it last reported",
            ["prefill"], registry=registry,
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
        for channel, _ in self._stubs.values():
            await channel.close()

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_s)
            await self.poll_once()

    async def poll_once(self) -> None:
        await asyncio.gather(
            *(self._probe(n) for n in self.decodes),
            *(self._probe_prefill(n) for n in self.prefills),
        )

    def forget(self, name: str) -> None:
        """A node is no longer at `name` (readdressed): its channel is closed."""
        gone = self._stubs.pop(name, None)
        if gone is not None:
            asyncio.ensure_future(gone[0].close())

    def _prefill_stub(self, address: str) -> tuple[grpc.aio.Channel, Any]:
        """A channel to a prefill node as its decodes open theirs: the cluster secret on every
        call, TLS where the router trusts a CA (--tls-ca)."""
        interceptors = client_interceptors(self.config.cluster_secret)
        if self.config.tls.ca:
            creds = channel_credentials(self.config.tls)
            channel = grpc.aio.secure_channel(
                address, creds, options=CHANNEL_OPTIONS, interceptors=interceptors
            )
        else:  # a node back from a restart found within a second (a short reconnect backoff)
            channel = grpc.aio.insecure_channel(
                address, options=CHANNEL_OPTIONS, interceptors=interceptors
            )
        return channel, pb_grpc.PrefillServiceStub(channel)  # type: ignore[no-untyped-call]  # generated gRPC code is unannotated

    async def _probe_prefill(self, node: Node) -> None:
        timeout = self.config.probe_timeout_s
        if node.name not in self._stubs:
            self._stubs[node.name] = self._prefill_stub(node.name)
        stub = self._stubs[node.name][1]
        try:
            await stub.GetPeerInfo(pb.PeerInfoRequest(), timeout=timeout)  # refused if broken
            stats = await stub.GetStats(pb.StatsRequest(), timeout=timeout)
            if self.kv_views is not None:
                view = self.kv_views[node.name]
                request = pb.KVEventsRequest(since=view.seq, epoch=view.epoch or "")
                events = await stub.GetKVEvents(request, timeout=timeout)
                gone = view.apply_keys(
                    events.epoch, events.seq, events.reset, events.stored, events.removed
                )
                self.on_gone(node.name, gone)
                self.prefill_kv_blocks.labels(node.name).set(len(view.keys))
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                if node.name not in self._unauthorized:
                    self._unauthorized.add(node.name)
                    logger.error(
                        "prefill %s refuses the router's credentials (%s): give the router the "
                        "nodes' --cluster-secret-file; it routes there blind meanwhile",
                        node.name, e.details(),
                    )  # fmt: skip
                self.set_health(node, True)
                return
            logger.debug("prefill %s probe failed: %s", node.name, e)
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._timed_out(node)
                return
            self.set_health(node, False)
            self._report(node, 0)
            return
        self._unauthorized.discard(node.name)
        node.probe_timeouts = 0
        self.set_health(node, True)
        self._report(node, stats.num_requests)
        if stats.num_blocks:
            used = 1 - stats.num_free_blocks / stats.num_blocks
            self.prefill_kv_usage.labels(node.name).set(used)

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
        except httpx.TimeoutException as e:  # busy, or frozen: counted, not final at once
            logger.debug("decode %s probe timed out: %s", node.name, e)
            self._timed_out(node)
            return
        except (httpx.HTTPError, ValueError, KeyError) as e:
            logger.debug("decode %s probe failed: %s", node.name, e)
            ok, reported = False, 0
        node.probe_timeouts = 0
        self.set_health(node, ok)
        self._report(node, reported)

    def _timed_out(self, node: Node) -> None:
        """A probe that got no answer in time: a node busy computing (resumed streams' prompts,
        say) is slow to answer, not dead; `PROBE_TIMEOUTS_TO_FAIL` in a row say it is."""
        node.probe_timeouts += 1
        if node.probe_timeouts >= PROBE_TIMEOUTS_TO_FAIL:
            self.set_health(node, False)
            self._report(node, 0)

    def _report(self, node: Node, requests: int) -> None:
        node.reported = requests
        self.requests.labels(node.name).set(requests)

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
            self.on_gone(node.name, view.apply(r.json()))
            self.kv_blocks.labels(node.name).set(len(view.keys))

    def set_health(self, node: Node, ok: bool) -> None:
        if ok != node.healthy:
            kind = "prefill" if any(n is node for n in self.prefills) else "decode"
            logger.warning("%s %s is %s", kind, node.name, "back" if ok else "unavailable")
            if ok:  # it restarted, or came back: what it cached may be gone
                self.on_back(node)
        node.healthy = ok
        self.healthy.labels(node.name).set(1 if ok else 0)
