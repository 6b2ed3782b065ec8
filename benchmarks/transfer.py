"""KV transfer speed, side by side in one run: pdserve's TCP transport vs a plain socket, and
pdserve's NIXL transport vs NIXL's own agent reading the same descriptors.

Two processes on loopback. The receiver holds a decode-sized paged KV cache of SmolLM2-135M
(bf16: 30 layers, 3 KV heads, head dim 64, 16-token blocks) behind pdserve's resource store,
KV receiver and TCP receiver server; the sender pushes a prompt's KV the way the connector
does: one frame per (request, layer) naming that layer's target blocks, sent from block memory
and received into block memory, each frame acknowledged. Blocks are either one consecutive run
(what a fresh pool hands out) or scattered (no two adjacent: one buffer per block, the worst
case). In the same run the same number of bytes per layer moves through a plain
`socket.sendall` / `recv_into` pair, also from and into KV-cache-sized memory, unframed.

NIXL (UCX over loopback and shared memory: UCX_NET_DEVICES=lo): pdserve's backend announces
each layer and the receiver READs it (completion = the receiver's acknowledgement, as for TCP);
the raw ceiling is a bare NIXL agent in the receiver process READing the same block pairs, in
the same descriptors (one per run of consecutive ids), one layer after another.

    .venv/bin/python benchmarks/transfer.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

LAYERS, KV_HEADS, BLOCK, HEAD_DIM = 30, 3, 16, 64
NUM_BLOCKS = 512


def make_caches() -> list[torch.Tensor]:
    shape = (NUM_BLOCKS, 2, KV_HEADS, BLOCK, HEAD_DIM)
    return [torch.empty(shape, dtype=torch.bfloat16).normal_() for _ in range(LAYERS)]


def receiver_main(conn: Any) -> None:
    from pdserve.disagg.kv_receiver import KVReceiver
    from pdserve.disagg.resource_store import ResourceStore
    from pdserve.disagg.transport.nixl_agent import NixlAgent
    from pdserve.disagg.transport.nixl_receiver import NixlReceiver
    from pdserve.disagg.transport.regions import KVRegions
    from pdserve.disagg.transport.sockets import recv_exact
    from pdserve.disagg.transport.tcp_receiver import TcpReceiverServer

    caches = make_caches()
    store = ResourceStore()
    receiver = KVReceiver(store, KVRegions(caches))
    server = TcpReceiverServer(receiver.receive)
    nixl = NixlReceiver(receiver.open, receiver.regions)
    raw = NixlAgent("raw-decode", receiver.regions)  # the ceiling: a bare agent, same memory
    plain = socket.create_server(("127.0.0.1", 0))
    conn.send(
        (
            server.address,
            plain.getsockname()[1],
            receiver.regions.block_bytes,
            nixl.address,
            nixl.metadata(),
        )
    )
    nixl.add_peer(conn.recv())  # the sender's NixlPeer
    raw_peer = pb_peer(conn.recv())  # the raw sender agent's NixlPeer
    raw_name = raw.add_remote(raw_peer.agent_metadata)

    # The plain socket writes into KV-cache memory of the same size (cold, like the real one).
    flat = [memoryview(c.view(torch.uint8).reshape(-1).numpy()) for c in make_caches()]

    def plain_loop() -> None:
        sock, _ = plain.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            header = bytearray(16)
            recv_exact(sock, memoryview(header))
            layer, n = int.from_bytes(header[:8], "big"), int.from_bytes(header[8:], "big")
            if n == 0:
                return
            offset = (layer * 7919 * 4096) % (len(flat[layer]) - n)
            recv_exact(sock, flat[layer][offset : offset + n])
            sock.sendall(b"\x01")

    threading.Thread(target=plain_loop, daemon=True).start()
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg[0] == "raw":  # time the bare agent reading the same block pairs
            _, src, dst = msg
            conn.send(raw_read(raw, raw_name, raw_peer, src, dst))
            continue
        key, blocks = msg
        store.register(
            key, key, blocks, len(blocks), LAYERS, receiver.regions.block_bytes, time.time() + 60
        )
        conn.send("ok")
    server.stop()
    nixl.stop()


def pb_peer(data: bytes) -> Any:
    from pdserve.disagg.proto import pdserve_pb2 as pb

    return pb.NixlPeer.FromString(data)


def raw_read(agent: Any, peer: str, info: Any, src: list[int], dst: list[int]) -> float:
    """NIXL alone: per layer one READ of the block pairs (a descriptor per run), waited on."""
    from pdserve.disagg.transport.nixl_agent import run_descs

    size = agent.regions.block_bytes
    start = time.perf_counter()
    for layer in range(LAYERS):
        remote, local = run_descs(
            info.layer_addresses[layer], agent.layer_addresses[layer], src, dst, size
        )
        handle = agent.read(peer, local, remote)
        while (state := agent.state(handle)) == "PROC":
            pass
        assert state == "DONE", state
        agent.release(handle)
    return time.perf_counter() - start


def block_pairs(tokens: int, key: str, scattered: bool) -> tuple[list[int], list[int]]:
    n = -(-tokens // BLOCK)
    rng = random.Random(key)
    if scattered:  # no two blocks adjacent: one buffer per block on both ends
        src = sorted(rng.sample(range(0, NUM_BLOCKS, 2), n))
        dst = rng.sample(range(1, NUM_BLOCKS, 2), n)
    else:  # what a fresh pool hands out: one run of consecutive blocks
        first = rng.randrange(0, NUM_BLOCKS - n)
        src = dst = list(range(first, first + n))
    return src, dst


def raw_transfer(conn: Any, agent: Any, tokens: int, key: str, scattered: bool) -> float:
    """The receiver's bare agent reads; this side keeps its own agent progressing meanwhile."""
    conn.send(("raw", *block_pairs(tokens, key, scattered)))
    while not conn.poll(0):
        agent.notifications()
    return float(conn.recv())


def pdserve_transfer(
    sender: Any, conn: Any, address: str, tokens: int, key: str, scattered: bool
) -> float:
    from pdserve.disagg.transport.base import LayerWrite

    src, dst = block_pairs(tokens, key, scattered)
    conn.send((key, dst))
    assert conn.recv() == "ok"
    done = threading.Semaphore(0)
    errors: list[Exception] = []

    def complete(err: Exception | None) -> None:
        if err is not None:
            errors.append(err)
        done.release()

    start = time.perf_counter()
    for layer in range(LAYERS):
        sender.submit(LayerWrite(address, key, layer, src, dst, time.time() + 60, complete))
    for _ in range(LAYERS):
        done.acquire()
    elapsed = time.perf_counter() - start
    if errors:
        raise RuntimeError(errors[0])
    return elapsed


def plain_transfer(sock: socket.socket, flat: list[memoryview], per_layer: int) -> float:
    """The same bytes per layer, from KV-cache memory into KV-cache memory, no framing."""
    start = time.perf_counter()
    for layer in range(LAYERS):
        sock.sendall(layer.to_bytes(8, "big") + per_layer.to_bytes(8, "big"))
        offset = (layer * 104729 * 4096) % (len(flat[layer]) - per_layer)
        sock.sendall(flat[layer][offset : offset + per_layer])
    for _ in range(LAYERS):
        assert sock.recv(1) == b"\x01"
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/transfer.json")
    args = ap.parse_args()
    import os

    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback (and shared memory) only
    from pdserve.disagg.transport.nixl_agent import NixlAgent
    from pdserve.disagg.transport.nixl_sender import NixlSender
    from pdserve.disagg.transport.regions import KVRegions
    from pdserve.disagg.transport.tcp_sender import TcpSender

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child,), daemon=True)
    proc.start()
    try:
        address, plain_port, block_bytes, nixl_name, nixl_metadata = parent.recv()
        caches = make_caches()
        regions = KVRegions(caches)
        sender = TcpSender(regions)
        nixl = NixlSender(regions)
        problem = nixl.register_peer(nixl_name, nixl_metadata)
        assert problem is None, problem
        raw = NixlAgent("raw-prefill", regions)
        parent.send(nixl.metadata())
        parent.send(raw.peer_info())
        flat = [memoryview(c.view(torch.uint8).reshape(-1).numpy()) for c in caches]
        plain = socket.create_connection(("127.0.0.1", plain_port))
        plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        results = {}
        for tokens in (512, 2048):
            blocks = -(-tokens // BLOCK)
            per_layer = blocks * block_bytes
            total = per_layer * LAYERS
            for layout in ("consecutive", "scattered"):
                scattered = layout == "scattered"
                runs: dict[str, list[float]] = {"tcp": [], "plain": [], "nixl": [], "raw": []}

                for i in range(-1, args.repeats):  # -1 warms up; interleaved against drift
                    key = f"k{tokens}-{layout}-{i}"
                    sample = {
                        "tcp": pdserve_transfer(sender, parent, address, tokens, key, scattered),
                        "plain": plain_transfer(plain, flat, per_layer),
                        "nixl": pdserve_transfer(
                            nixl, parent, nixl_name, tokens, key + "n", scattered
                        ),
                        "raw": raw_transfer(parent, raw, tokens, key + "n", scattered),
                    }
                    for name, seconds in sample.items():
                        if i >= 0:
                            runs[name].append(seconds)
                gbs = {name: total / statistics.median(t) / 1e9 for name, t in runs.items()}
                results[f"{tokens}_tokens_{layout}_blocks"] = {
                    "bytes": total,
                    "blocks_per_layer": blocks,
                    "pdserve_tcp_GBps": gbs["tcp"],
                    "plain_socket_GBps": gbs["plain"],
                    "ratio": gbs["tcp"] / gbs["plain"],
                    "pdserve_nixl_GBps": gbs["nixl"],
                    "raw_nixl_GBps": gbs["raw"],
                    "nixl_vs_raw": gbs["nixl"] / gbs["raw"],
                    "nixl_vs_tcp": gbs["nixl"] / gbs["tcp"],
                    **{f"{name}_ms_median": statistics.median(t) * 1e3 for name, t in runs.items()},
                }
        plain.sendall((0).to_bytes(16, "big"))
        sender.close()
        nixl.close()
    finally:
        parent.send(None)
        proc.join(10)
    from pdserve.model.isa import host_description

    out = {
        "host": host_description(),
        "model": "SmolLM2-135M bf16 KV (30 layers, 3 kv heads, 64 dim, 16-token blocks)",
        "repeats": args.repeats,
        "ucx_net_devices": os.environ.get("UCX_NET_DEVICES"),
        "ucx_tls": os.environ.get("UCX_TLS", "(UCX's choice)"),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
