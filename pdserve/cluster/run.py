"""The `pdserve cluster` driver: joins (or starts) a Ray cluster, runs every prefill and decode
node as a restartable Ray actor (`actors.NodeActor`) on fixed ports, and serves the router in
front of them.

Lifecycle: `ray.init` (a local cluster advertising `node_ip` unless `address` names one) ->
prefill actors, then decode actors pointed at them, each ready before the next step (bounded)
-> the router and its HTTP server, a "ready" line naming every node -> on SIGHUP (or the
router's `POST /admin/rolling-restart`) every node restarts, one at a time, drained first, with
no request failing -> on SIGINT/SIGTERM the router stops, every node stops and its actor is
killed without restart, Ray shuts down.

Failures: a node's process that dies takes its actor with it; Ray restarts the actor, which
starts the node again on the same ports (on another machine if its own is gone: the driver
finds the new address and tells the router, which tells the decodes). Meanwhile the router's
health polling stops routing to a dead node within one poll and re-admits it once it answers;
a decode whose prefill is down uses another of its prefill nodes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from typing import Any

from pdserve.cluster.actors import NodeActor
from pdserve.config import DEFAULT_DRAIN_TIMEOUT_S, ClusterConfig, RouterConfig
from pdserve.router.app import Router
from pdserve.serve.http import HttpServer

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
READY_TIMEOUT_S = 60.0  # how long "ready" waits for the router to find the decodes healthy
STOP_TIMEOUT_S = 30.0
ADDRESS_POLL_S = 2.0  # how often the driver asks each actor where its node serves
INFO_TIMEOUT_S = 5.0  # an actor restarting answers later: asked again at the next poll


def _init_ray(config: ClusterConfig) -> Any:
    # Without this Ray refuses a local multi-node setup advertising loopback (see issue 13).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False)
    if config.address is None:
        kwargs["_node_ip_address"] = config.node_ip
    # No --address: a cluster of our own ("local"), never one that `ray start` left running on
    # this machine (which Ray's default, None, would join).
    ray.init(address=config.address or "local", **kwargs)
    return ray


def _actor(ray: Any, config: ClusterConfig, resource: str | None) -> Any:
    options: dict[str, Any] = dict(max_restarts=-1, num_cpus=config.cpus_per_node)
    if resource:
        options["resources"] = {resource: 1}
    return ray.remote(**options)(NodeActor)


async def _start_nodes(
    ray: Any, config: ClusterConfig, actors: list[Any]
) -> tuple[list[str], list[str]]:
    """Start the prefill actors, then the decode actors pointed at them (each appended to
    `actors` at once, so a failure still stops it); their gRPC and HTTP addresses."""
    ip = config.node_ip if config.address is None else None
    prefill_cls = _actor(ray, config, config.prefill_resource)
    decode_cls = _actor(ray, config, config.decode_resource)
    for i in range(config.num_prefill):
        grpc = str(config.prefill_port_base + i)
        args = [*config.node_args, "--grpc-port", grpc, "--port", "0"]
        actors.append(prefill_cls.remote("prefill", args, ip))
    infos = await asyncio.to_thread(ray.get, [a.info.remote() for a in actors])
    prefills = [info["grpc"] for info in infos]
    peers = [a for p in prefills for a in ("--prefill", p)]
    for i in range(config.num_decode):
        http = str(config.decode_port_base + i)
        args = [*config.node_args, "--port", http, "--grpc-port", "0"]
        args += ["--transfer-port", "0", *peers]
        actors.append(decode_cls.remote("decode", args, ip))
    infos = await asyncio.to_thread(
        ray.get, [a.info.remote() for a in actors], timeout=START_TIMEOUT_S
    )
    roles = ["prefill"] * config.num_prefill + ["decode"] * config.num_decode
    for role, info in zip(roles, infos, strict=True):
        fields = " ".join(f"{k}={v}" for k, v in info.items())
        print(f"pdserve cluster node {role} {fields}", flush=True)
    return prefills, [info["http"] for info in infos[config.num_prefill :]]


async def _until_healthy(router: Router, nodes: list[Any], timeout_s: float) -> bool:
    """Probe until the router finds every one of `nodes` healthy, or `timeout_s` passes; whether
    it did. A decode just started answers 503 until it has reached a prefill node."""
    deadline = time.monotonic() + timeout_s
    await router.monitor.poll_once()
    while not all(n.healthy for n in nodes) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        await router.monitor.poll_once()
    return all(n.healthy for n in nodes)


async def rolling_restart(
    ray: Any, router: Router, actors: list[Any], num_prefill: int, timeout_s: float
) -> dict[str, Any]:
    """Restart every node, one at a time, under load: each decode is drained (its streams go
    on from the others, `Router.drain`), restarted, waited for until the router finds it
    healthy, and put back; each prefill is taken out of the router's choices, restarted once
    no request the router sent it is in flight, and put back. What was done, per node."""
    done: list[dict[str, Any]] = []
    prefill_nodes, decode_nodes = router.prefills, router.decodes
    for actor, node in zip(actors[num_prefill:], decode_nodes, strict=True):
        try:  # whatever fails, the node goes back into rotation
            drained = await router.drain(node.name, timeout_s)
            await asyncio.to_thread(ray.get, actor.restart.remote(), timeout=START_TIMEOUT_S)
            await _until_healthy(router, [node], timeout_s)
        finally:
            router.undrain(node.name)
        done.append({"decode": node.name, "moved": drained["moved"], "healthy": node.healthy})
    for actor, node in zip(actors[:num_prefill], prefill_nodes, strict=True):
        node.draining = True
        try:
            deadline = time.monotonic() + timeout_s
            while node.in_flight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(ray.get, actor.restart.remote(), timeout=START_TIMEOUT_S)
        finally:
            node.draining = False
        done.append({"prefill": node.name})
    logger.warning("rolling restart done: %s", done)
    print(f"pdserve cluster rolling restart done nodes={len(done)}", flush=True)
    return {"restarted": done}


async def follow_addresses(ray: Any, router: Router, actors: list[Any]) -> None:
    """Keep the router's node addresses true: a node whose actor Ray restarted on another
    machine serves at that machine's address (same port); the router is told
    (`Router.readdress`, which tells the decodes of a moved prefill node). Runs until
    cancelled."""
    while True:
        await asyncio.sleep(ADDRESS_POLL_S)
        nodes = [*router.prefills, *router.decodes]  # in the order of `actors`
        keys = ["grpc"] * len(router.prefills) + ["http"] * len(router.decodes)
        infos = await asyncio.gather(
            *(asyncio.to_thread(ray.get, a.info.remote(), timeout=INFO_TIMEOUT_S) for a in actors),
            return_exceptions=True,
        )
        for node, key, info in zip(nodes, keys, infos, strict=True):
            if isinstance(info, BaseException) or not info.get(key):
                continue  # restarting (or gone): asked again at the next poll
            if info[key] != node.name:
                old = node.name
                await router.readdress(old, info[key])
                print(f"pdserve cluster node moved {old} -> {info[key]}", flush=True)


async def serve_cluster(
    config: ClusterConfig, router_config: RouterConfig, host: str, port: int
) -> None:
    # On this (main) thread, before our handlers: Ray's core worker installs its own SIGTERM
    # handler, which ours then replace (so a stop still runs the cleanup below).
    ray = _init_ray(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    restarts: list[asyncio.Task[dict[str, Any]]] = []
    follow: asyncio.Task[None] | None = None
    actors: list[Any] = []
    router: Router | None = None
    server: HttpServer | None = None
    try:
        prefills, decodes = await _start_nodes(ray, config, actors)
        router = Router(
            dataclasses.replace(router_config, decodes=tuple(decodes), prefills=tuple(prefills))
        )
        await router.start()
        running = router
        # Ready means routable: the router's first probe may have found a decode that had not
        # yet reached its prefill (its /health 503 then), which would refuse the first requests.
        if not await _until_healthy(router, router.decodes, READY_TIMEOUT_S):
            down = [n.name for n in router.decodes if not n.healthy]
            logger.warning(
                "decodes %s not healthy after %.0fs; serving anyway", down, READY_TIMEOUT_S
            )

        async def restart_all() -> dict[str, Any]:
            return await rolling_restart(
                ray, running, actors, config.num_prefill, DEFAULT_DRAIN_TIMEOUT_S
            )

        def on_hup() -> None:  # one rolling restart at a time
            if not restarts or restarts[-1].done():
                restarts.append(asyncio.create_task(restart_all()))
                restarts[-1].add_done_callback(_report_restart)

        router.rolling_restart = restart_all  # POST /admin/rolling-restart
        follow = asyncio.create_task(follow_addresses(ray, running, actors))
        loop.add_signal_handler(signal.SIGHUP, on_hup)
        server = HttpServer(router.app, host, port, router.config.tls)
        await server.start()
        print(
            f"pdserve cluster ready http=http://{server.address} decodes={','.join(decodes)} "
            f"prefills={','.join(prefills)}",
            flush=True,
        )
        await stop.wait()
    finally:
        for task in [*restarts, *([follow] if follow is not None else [])]:
            task.cancel()
        if server is not None:
            await server.stop()
        if router is not None:
            await router.stop()
        await asyncio.to_thread(_stop_actors, ray, actors)
        await asyncio.to_thread(ray.shutdown)


def _report_restart(task: asyncio.Task[dict[str, Any]]) -> None:
    """Say why a rolling restart (SIGHUP) failed: no one awaits its task."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("rolling restart failed: %r", task.exception())
        print(f"pdserve cluster rolling restart failed: {task.exception()!r}", flush=True)


def _stop_actors(ray: Any, actors: list[Any]) -> None:
    """Stop every node gracefully where its actor answers, then kill the actors for good."""
    refs = [a.stop.remote() for a in actors]
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for ref in refs:  # each waited for: one actor's failure must not cut the others' stop short
        try:
            ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except Exception as e:  # a dead or restarting actor: killed below all the same
            logger.warning("a node did not stop gracefully: %s", e)
    for a in actors:
        ray.kill(a, no_restart=True)
