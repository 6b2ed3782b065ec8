"""KV transfer speed, side by side in one run: pdserve's TCP transport vs a plain socket, and
pdserve's NIXL transport vs NIXL's own agent reading the same descriptors.

Each backend in a sender and a receiver process of its own on loopback (a node runs one
backend: no other backend's threads poll beside it). The receiver holds a decode-sized paged KV
cache of SmolLM2-135M (bf16: 30 layers, 3 KV heads, head dim 64, 16-token blocks) behind
pdserve's resource store, KV receiver and transport; the sender pushes a prompt's KV the way the
connector does: one write per (request, layer) naming that layer's target blocks (TCP sends the
layers that queued up as one frame), sent from block memory and received into block memory,
each acknowledged; the entry is then cancelled, as decode's claim would end it. Blocks are
either one consecutive run (what a fresh pool hands out) or scattered (no two adjacent: one
buffer per block, the worst case). In the same run the same number of bytes per layer moves
through a plain socket, also from and into KV-cache-sized memory, unframed and unchecked: one
contiguous span per layer at places drawn per transfer (as cold as pdserve's blocks;
`ratio`), and the very blocks pdserve moved, by scatter-gather (`ratio_vs_same_blocks`: for
scattered blocks the kernel's own cost of many small buffers, ~1.4x here, is in both).

NIXL (UCX over loopback and shared memory: UCX_NET_DEVICES=lo): pdserve's backend announces
each layer and the receiver READs it (completion = the receiver's acknowledgement, as for TCP);
the raw ceiling is a bare NIXL agent in the receiver process READing the same block pairs, in
the same descriptors (one per run of consecutive ids), one layer after another.

`--kv-checksum`'s cost, alternating in the same run: each transport again with prefill
checksumming every layer from its blocks and decode verifying its blocks before acknowledging
(`tcp_checksum_vs_tcp`, `nixl_checksum_vs_nixl`).

Sliding windows (`window`): Gemma 3 270M's KV (bf16: 18 layers, 1 KV head, head dim 256; every
sixth layer global, the others windowed at 512 positions) for a 2,048-token prompt, through
pdserve's connector (`KVSender` over its TCP transport) as a node with the windows sends it and
as one sending every layer's every block, alternating: the bytes decode's store received and
the time.

    .venv/bin/python benchmarks/transfer.py [--repeats 100] [--cases tcp,nixl,window]
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
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

LAYERS, KV_HEADS, BLOCK, HEAD_DIM = 30, 3, 16, 64
NUM_BLOCKS = 512
WARMUP = 3  # rounds of every variant before the timed ones (TCP's buffers grow as data flows)
# (layers, KV heads, head dim) of each model's KV, bf16
SHAPES = {"smollm2": (LAYERS, KV_HEADS, HEAD_DIM), "gemma3-270m": (18, 1, 256)}
GEMMA3_WINDOW, GEMMA3_GLOBAL_EVERY = 512, 6


def make_caches(model: str = "smollm2") -> list[torch.Tensor]:
    """KV-cache memory as a node allocates it (huge pages where the host has them), for
    pdserve's transport and the plain socket alike."""
    from pdserve.engine.kv_cache import allocate_kv_layer

    layers, kv_heads, head_dim = SHAPES[model]
    shape = (NUM_BLOCKS, 2, kv_heads, BLOCK, head_dim)
    return [allocate_kv_layer(shape, torch.bfloat16).normal_() for _ in range(layers)]


def receiver_main(conn: Any, backend: str, model: str = "smollm2") -> None:
    """Decode's side of one backend (a node runs one): "tcp" with the plain socket beside it,
    or "nixl" with the bare agent beside it. An entry is cancelled once its transfer is timed,
    as decode's claim would end it, so nothing waits on a finished key."""
    from pdserve.disagg.kv_receiver import KVReceiver
    from pdserve.disagg.resource_store import ResourceStore
    from pdserve.disagg.transport.regions import KVRegions

    caches = make_caches(model)
    wake: list[Any] = []  # a registration wakes the NIXL receiver, as on a decode node
    store = ResourceStore(on_register=lambda: [w() for w in wake])
    receiver = KVReceiver(store, KVRegions(caches))
    if backend == "tcp":
        stop = _serve_tcp(conn, receiver)
    else:
        stop = _serve_nixl(conn, receiver, store.expecting, wake)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg[0] == "raw":  # time the bare agent reading the same block pairs
            conn.send(stop.raw(*msg[1:]))
            continue
        if msg[0] == "done":
            store.cancel(msg[1])
            conn.send("ok")
            continue
        if msg[0] == "verify":  # --kv-checksum on decode's side, or not
            receiver.verify = msg[1]
            conn.send("ok")
            continue
        if msg[0] == "bytes":  # what the store has received so far
            conn.send(store.bytes_received)
            continue
        key, blocks, *per_layer = msg  # each layer's block count, where they differ
        expected = per_layer[0] if per_layer else len(blocks)
        block_bytes = receiver.regions.block_bytes
        store.register(key, key, blocks, expected, len(caches), block_bytes, time.time() + 60)
        conn.send("ok")
    stop.close()


class _Side:
    def __init__(self, close: Any, raw: Any = None) -> None:
        self.close, self.raw = close, raw


def _serve_tcp(conn: Any, receiver: Any) -> _Side:
    """pdserve's TCP receiver, and a plain socket writing into KV-cache memory of the same size
    (cold, like the real one)."""
    from pdserve.disagg.transport.sockets import recv_exact
    from pdserve.disagg.transport.tcp_receiver import TcpReceiverServer

    server = TcpReceiverServer(receiver.receive)
    plain = socket.create_server(("127.0.0.1", 0))
    conn.send((server.address, plain.getsockname()[1], receiver.regions.block_bytes))
    flat = [memoryview(c.view(torch.uint8).reshape(-1).numpy()) for c in make_caches()]

    def plain_loop() -> None:
        sock, _ = plain.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            header = bytearray(24)
            recv_exact(sock, memoryview(header))
            layer, spans, size = (int.from_bytes(header[i : i + 8], "big") for i in (0, 8, 16))
            if spans == 0:
                return
            places = bytearray(8 * spans)
            recv_exact(sock, memoryview(places))
            at = [int.from_bytes(places[i : i + 8], "big") for i in range(0, len(places), 8)]
            views = [flat[layer][a : a + size] for a in at]
            for chunk in _megabytes(views):  # MSG_WAITALL a megabyte at a time
                need = sum(len(v) for v in chunk)
                while need:
                    need -= sock.recvmsg_into(chunk, 0, socket.MSG_WAITALL)[0]
                    assert need == 0
            sock.sendall(b"\x01")

    threading.Thread(target=plain_loop, daemon=True).start()
    return _Side(server.stop)


def _serve_nixl(conn: Any, receiver: Any, expecting: Any, wake: list[Any]) -> _Side:
    """pdserve's NIXL receiver (polling fast only while an entry waits, as on a node), and a bare
    agent on the same memory: the ceiling."""
    from pdserve.disagg.transport.nixl_agent import NixlAgent
    from pdserve.disagg.transport.nixl_receiver import NixlReceiver

    nixl = NixlReceiver(receiver.open, receiver.regions, expecting)
    wake.append(nixl.wake)
    raw = NixlAgent("raw-decode", receiver.regions)
    conn.send((nixl.address, nixl.metadata()))
    nixl.add_peer(conn.recv())  # the sender's NixlPeer
    raw_peer = pb_peer(conn.recv())  # the raw sender agent's NixlPeer
    raw_name = raw.add_remote(raw_peer.agent_metadata)
    return _Side(nixl.stop, lambda src, dst: raw_read(raw, raw_name, raw_peer, src, dst))


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
    sender: Any,
    conn: Any,
    address: str,
    tokens: int,
    key: str,
    scattered: bool,
    checksum: bool = False,
) -> float:
    """One prompt's KV through pdserve's transport, `checksum`: with --kv-checksum on both
    sides (prefill checksums each layer from its blocks, decode verifies its blocks)."""
    from pdserve.disagg.transport.base import LayerWrite

    src, dst = block_pairs(tokens, key, scattered)
    sender.checksum = checksum
    conn.send(("verify", checksum))
    assert conn.recv() == "ok"
    conn.send((key, dst))
    assert conn.recv() == "ok"
    # Completions counted down, the caller woken once at the last (as the connector's KVSender
    # counts its writes): a wake-up per write (a semaphore released 30 times by the thread
    # reading acks while this one takes it) cost ~0.25 ms of every transfer here.
    finished = threading.Event()
    left = [LAYERS]
    errors: list[Exception] = []
    lock = threading.Lock()

    def complete(err: Exception | None) -> None:
        with lock:
            if err is not None:
                errors.append(err)
            left[0] -= 1
            if not left[0]:
                finished.set()

    start = time.perf_counter()
    for layer in range(LAYERS):
        sender.submit(LayerWrite(address, key, layer, src, dst, time.time() + 60, complete))
    assert finished.wait(60), "the transfer never completed"
    elapsed = time.perf_counter() - start
    conn.send(("done", key))
    assert conn.recv() == "ok"
    if errors:
        raise RuntimeError(errors[0])
    return elapsed


def _megabytes(views: list[memoryview]) -> list[list[memoryview]]:
    """Views in runs of at most a megabyte (one larger view alone), for one call each."""
    out: list[list[memoryview]] = [[]]
    size = 0
    for v in views:
        if out[-1] and size + len(v) > 1 << 20:
            out.append([])
            size = 0
        out[-1].append(v)
        size += len(v)
    return out


def plain_transfer(
    sock: socket.socket, flat: list[memoryview], spans: list[tuple[int, int]], size: int
) -> float:
    """The same bytes per layer through a plain socket, no framing, no checks, no threads:
    `spans` (source offset, destination offset) of `size` bytes each, the same in every layer,
    sent with scatter-gather sendmsg and received with recvmsg_into."""
    places = b"".join(dst.to_bytes(8, "big") for _, dst in spans)
    start = time.perf_counter()
    for layer in range(LAYERS):
        sock.sendall(b"".join(x.to_bytes(8, "big") for x in (layer, len(spans), size)) + places)
        for chunk in _megabytes([flat[layer][src : src + size] for src, _ in spans]):
            sock.sendmsg(chunk)  # blocking: the whole chunk
    for _ in range(LAYERS):
        assert sock.recv(1) == b"\x01"
    return time.perf_counter() - start


def contiguous_spans(flat: list[memoryview], size: int, key: str) -> list[tuple[int, int]]:
    """One span per layer at places drawn per transfer on each side (as pdserve's blocks are),
    so neither side re-reads memory a previous repeat left in the cache."""
    rng = random.Random(key + "plain")
    return [(rng.randrange(0, len(flat[0]) - size), rng.randrange(0, len(flat[0]) - size))]


def block_spans(tokens: int, key: str, block_bytes: int, scattered: bool) -> list[tuple[int, int]]:
    """The spans of the very blocks pdserve moved in that transfer."""
    src, dst = block_pairs(tokens, key, scattered)
    return [(s * block_bytes, d * block_bytes) for s, d in zip(src, dst, strict=True)]


def _receiver(backend: str, model: str = "smollm2") -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child, backend, model), daemon=True)
    proc.start()
    return parent, proc


def _cases() -> list[tuple[int, str]]:
    return [(tokens, layout) for tokens in (512, 2048) for layout in ("consecutive", "scattered")]


def rotated(i: int, runs: dict[str, Callable[[], float]]) -> dict[str, float]:
    """Each of `runs` timed once, starting at the i-th (in turn): no variant always runs
    right after another, whose caches it would find."""
    names = list(runs)
    start = i % len(names)
    return {name: runs[name]() for name in names[start:] + names[:start]}


def _median_gbps(runs: dict[str, list[float]], total: int) -> dict[str, float]:
    return {name: total / statistics.median(t) / 1e9 for name, t in runs.items()}


def measure_tcp(repeats: int, results: dict[str, dict[str, Any]]) -> None:
    """pdserve's TCP transport vs a plain socket, alternating, in a sender and a receiver
    process that hold nothing else."""
    from pdserve.disagg.transport.regions import KVRegions
    from pdserve.disagg.transport.tcp_sender import TcpSender

    parent, proc = _receiver("tcp")
    try:
        address, plain_port, block_bytes = parent.recv()
        caches = make_caches()
        sender = TcpSender(KVRegions(caches))
        flat = [memoryview(c.view(torch.uint8).reshape(-1).numpy()) for c in caches]
        plain = socket.create_connection(("127.0.0.1", plain_port))
        plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for tokens, layout in _cases():
            per_layer = -(-tokens // BLOCK) * block_bytes
            scattered = layout == "scattered"
            runs: dict[str, list[float]] = {
                "tcp": [],
                "tcp_checksum": [],
                "plain": [],
                "plain_same_blocks": [],
            }
            for i in range(-WARMUP, repeats):  # interleaved against drift
                key = f"k{tokens}-{layout}-{i}"
                same = block_spans(tokens, key, block_bytes, scattered)
                sample = rotated(i, {
                    "tcp": partial(pdserve_transfer, sender, parent, address, tokens, key,
                                   scattered),
                    "tcp_checksum": partial(pdserve_transfer, sender, parent, address, tokens,
                                            key + "c", scattered, checksum=True),
                    "plain": partial(plain_transfer, plain, flat,
                                     contiguous_spans(flat, per_layer, key), per_layer),
                    "plain_same_blocks": partial(plain_transfer, plain, flat, same, block_bytes),
                })  # fmt: skip
                for name, seconds in sample.items():
                    if i >= 0:
                        runs[name].append(seconds)
            gbs = _median_gbps(runs, per_layer * LAYERS)
            results[f"{tokens}_tokens_{layout}_blocks"] = {
                "bytes": per_layer * LAYERS,
                "blocks_per_layer": -(-tokens // BLOCK),
                "pdserve_tcp_GBps": gbs["tcp"],
                "plain_socket_GBps": gbs["plain"],
                "ratio": gbs["tcp"] / gbs["plain"],
                "plain_same_blocks_GBps": gbs["plain_same_blocks"],
                "ratio_vs_same_blocks": gbs["tcp"] / gbs["plain_same_blocks"],
                "pdserve_tcp_checksum_GBps": gbs["tcp_checksum"],
                "tcp_checksum_vs_tcp": gbs["tcp_checksum"] / gbs["tcp"],
                **{f"{name}_ms_median": statistics.median(t) * 1e3 for name, t in runs.items()},
            }
        plain.sendall((0).to_bytes(24, "big"))
        sender.close()
    finally:
        parent.send(None)
        proc.join(10)


def measure_nixl(repeats: int, results: dict[str, dict[str, Any]]) -> None:
    """pdserve's NIXL transport vs a bare NIXL agent reading the same descriptors,
    alternating, in processes of their own."""
    from pdserve.disagg.transport.nixl_agent import NixlAgent
    from pdserve.disagg.transport.nixl_sender import NixlSender
    from pdserve.disagg.transport.regions import KVRegions

    parent, proc = _receiver("nixl")
    try:
        nixl_name, nixl_metadata = parent.recv()
        regions = KVRegions(make_caches())
        nixl = NixlSender(regions)
        problem = nixl.register_peer(nixl_name, nixl_metadata)
        assert problem is None, problem
        raw = NixlAgent("raw-prefill", regions)
        parent.send(nixl.metadata())
        parent.send(raw.peer_info())
        for tokens, layout in _cases():
            runs: dict[str, list[float]] = {"nixl": [], "nixl_checksum": [], "raw": []}
            for i in range(-WARMUP, repeats):
                key = f"k{tokens}-{layout}-{i}n"
                scattered = layout == "scattered"
                sample = rotated(i, {
                    "nixl": partial(pdserve_transfer, nixl, parent, nixl_name, tokens, key,
                                    scattered),
                    "nixl_checksum": partial(pdserve_transfer, nixl, parent, nixl_name, tokens,
                                             key + "c", scattered, checksum=True),
                    "raw": partial(raw_transfer, parent, raw, tokens, key, scattered),
                })  # fmt: skip
                for name, seconds in sample.items():
                    if i >= 0:
                        runs[name].append(seconds)
            case = results[f"{tokens}_tokens_{layout}_blocks"]
            gbs = _median_gbps(runs, case["bytes"])
            case.update(
                {
                    "pdserve_nixl_GBps": gbs["nixl"],
                    "raw_nixl_GBps": gbs["raw"],
                    "nixl_vs_raw": gbs["nixl"] / gbs["raw"],
                    "nixl_vs_tcp": gbs["nixl"] / case["pdserve_tcp_GBps"],
                    "pdserve_nixl_checksum_GBps": gbs["nixl_checksum"],
                    "nixl_checksum_vs_nixl": gbs["nixl_checksum"] / gbs["nixl"],
                    **{f"{n}_ms_median": statistics.median(t) * 1e3 for n, t in runs.items()},
                }
            )
        nixl.close()
    finally:
        parent.send(None)
        proc.join(10)


def measure_window(repeats: int, results: dict[str, dict[str, Any]]) -> None:
    """A 2,048-token prompt of Gemma 3 270M's KV through pdserve's connector and TCP transport,
    with its sliding windows and with every layer's every block, alternating (see the module's
    docstring)."""
    from pdserve.disagg.kv_sender import KVSender
    from pdserve.disagg.send_target import PrefillOutcome, SendTarget
    from pdserve.disagg.transport.regions import KVRegions
    from pdserve.disagg.transport.tcp_sender import TcpSender
    from pdserve.engine.kv_manager import first_block_sent

    model, tokens = "gemma3-270m", 2048
    layers = SHAPES[model][0]
    windows = tuple(
        None if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else GEMMA3_WINDOW for i in range(layers)
    )
    parent, proc = _receiver("tcp", model)
    try:
        address, _, _ = parent.recv()
        transport = TcpSender(KVRegions(make_caches(model)))
        ways = {"all_layers": (None,) * layers, "window": windows}
        runs: dict[str, list[float]] = {name: [] for name in ways}
        received: dict[str, int] = {}
        for i in range(-1, repeats):  # -1 warms up; the two alternate
            for name, per_layer in ways.items():
                key = f"w{i}-{name}"
                src, dst = block_pairs(tokens, key, scattered=False)
                expected = [len(dst) - first_block_sent(w, tokens, BLOCK) for w in per_layer]
                parent.send(("bytes",))
                before = parent.recv()
                parent.send((key, dst, expected))
                assert parent.recv() == "ok"
                woken = threading.Event()
                sender = KVSender(transport, layers, BLOCK, wake=woken.set, windows=per_layer)
                outcomes: list[PrefillOutcome] = []
                target = SendTarget(key, key, address, dst, 0, time.time() + 60, num_tokens=tokens)
                start = time.perf_counter()
                sender.send_computed(target, src, BLOCK, outcomes.append)
                while not outcomes:  # the last write acknowledged
                    woken.wait(60)
                    woken.clear()
                    sender.poll_finished_sends()
                elapsed = time.perf_counter() - start
                assert outcomes[0].failure is None, outcomes[0].failure
                parent.send(("done", key))
                assert parent.recv() == "ok"
                parent.send(("bytes",))
                received[name] = parent.recv() - before
                if i >= 0:
                    runs[name].append(elapsed)
        transport.close()
    finally:
        parent.send(None)
        proc.join(10)
    ms = {name: statistics.median(t) * 1e3 for name, t in runs.items()}
    results[f"gemma3_{tokens}_tokens_window"] = {
        "model": "Gemma 3 270M bf16 KV (18 layers, 1 kv head, 256 dim, 16-token blocks; "
        f"every {GEMMA3_GLOBAL_EVERY}th layer global, the others windowed at {GEMMA3_WINDOW})",
        "bytes_all_layers": received["all_layers"],
        "bytes_window": received["window"],
        "bytes_ratio": received["window"] / received["all_layers"],
        "all_layers_ms_median": ms["all_layers"],
        "window_ms_median": ms["window"],
        "time_ratio": ms["window"] / ms["all_layers"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--repeats",
        type=int,
        default=100,
        help="timed rounds per case (a 512-token transfer is a few ms: the medians need many)",
    )
    ap.add_argument("--out", default="benchmarks/results/transfer.json")
    ap.add_argument("--cases", default="tcp,nixl,window",
                    help="which measurements, comma-separated (nixl needs tcp's)")  # fmt: skip
    args = ap.parse_args()
    cases = set(args.cases.split(","))
    unknown = cases - {"tcp", "nixl", "window"}
    if unknown or ("nixl" in cases and "tcp" not in cases):
        ap.error(f"--cases: tcp, nixl (with tcp), window; got {args.cases!r}")
    import os

    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback (and shared memory) only
    results: dict[str, dict[str, Any]] = {}
    if "tcp" in cases:
        measure_tcp(args.repeats, results)
    if "nixl" in cases:
        measure_nixl(args.repeats, results)
    if "window" in cases:
        measure_window(args.repeats, results)
    from pdserve.model.hugepages import thp_mode
    from pdserve.model.isa import host_description

    out = {
        "host": host_description(),
        "model": "SmolLM2-135M bf16 KV (30 layers, 3 kv heads, 64 dim, 16-token blocks)"
        if "tcp" in cases
        else "see each result",
        "repeats": args.repeats,
        "transparent_huge_pages": thp_mode(),
        "ucx_net_devices": os.environ.get("UCX_NET_DEVICES"),
        "ucx_tls": os.environ.get("UCX_TLS", "(UCX's choice)"),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
