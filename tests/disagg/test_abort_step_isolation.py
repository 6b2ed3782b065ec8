"""An abort while prefill is still writing a frame into the request's blocks costs the other
requests on the decode node nothing, counted in engine steps (the engine's own clock), not in
wall time: the abort takes effect at the next turn, another stream's tokens keep coming one per
step, and the aborted request's blocks stay held (not reused under the frame) for as long as
the frame is in the air. A real decode node (tiny random model, TCP receiver) and a prefill
peer on loopback that starts a frame and goes silent mid-payload."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, NodeConfig
from pdserve.disagg.kv_loader import KVLoader
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.disagg.transport.base import encode_header
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import Migration, RequestOptions, Resume, SamplingParams
from pdserve.serve.decode_node import DecodeNode
from pdserve.serve.engine_node import node_fingerprint
from tests.disagg.kvfixtures import connect
from tests.helpers import make_engine, make_tiny_model

BLOCK_SIZE = 16


class SilentMidFrame(pb_grpc.PrefillServiceServicer):
    """Answers the probe like a real prefill; on Prefill it opens a transfer connection to the
    decode, sends one layer-0 frame's header and half its payload, and never finishes."""

    def __init__(self, fp: pb.ModelFingerprint, block_bytes: int) -> None:
        self.fp = fp
        self.block_bytes = block_bytes
        self.sockets: list[socket.socket] = []
        self.unique_key = ""
        self.fail_call = asyncio.Event()  # set: the call fails so, the frame hangs on
        self.fail_with = (grpc.StatusCode.UNAVAILABLE, "prefill node going down")

    async def GetPeerInfo(self, request: pb.PeerInfoRequest, context: object) -> pb.PeerInfo:
        return pb.PeerInfo(tp_size=1, fingerprint=self.fp, role="prefill")

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        sock = connect(request.decode_transfer_address)
        self.sockets.append(sock)
        blocks = list(request.target_block_ids)
        header = pb.TransferFrameHeader(
            kind=pb.TransferFrameHeader.DATA,
            unique_key=request.unique_key,
            layer=0,
            block_ids=blocks,
            block_bytes=self.block_bytes,
        )
        sock.sendall(encode_header(header) + b"\x01" * (len(blocks) * self.block_bytes // 2))
        self.unique_key = request.unique_key
        await self.fail_call.wait()  # silent mid-frame until then (or decode cancels the call)
        await context.abort(*self.fail_with)
        raise AssertionError("unreachable")


@dataclass
class Stream:
    """Outputs of one request with the engine step at which each was delivered."""

    steps: list[int] = field(default_factory=list)
    last: RequestOutput | None = None
    done: threading.Event = field(default_factory=threading.Event)


def record(stream: Stream, node: DecodeNode):  # type: ignore[no-untyped-def]
    stats = node.engine_thread.engine.scheduler.stats

    def on_output(out: RequestOutput) -> None:  # engine thread: reads its own clock
        stream.steps.append(stats.num_steps)
        stream.last = out
        if out.finished:
            stream.done.set()

    return on_output


def wait_until(cond, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@dataclass
class Rig:
    node: DecodeNode
    peer: SilentMidFrame
    loader: KVLoader
    model_dir: Path
    loop: asyncio.AbstractEventLoop
    server: grpc.aio.Server  # the peer's
    address: str


@pytest.fixture
def rig(tmp_path: Path, loop: asyncio.AbstractEventLoop) -> Iterator[Rig]:
    """A real decode node whose one prefill peer starts a frame and goes silent mid-payload."""
    model_dir = make_tiny_model(tmp_path / "tiny")
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)  # noqa: E731
    engine_config = EngineConfig(
        dtype="float32",
        num_threads=1,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=64),
    )
    model = ModelConfig.from_dir(model_dir)
    block_bytes = 2 * model.num_kv_heads * BLOCK_SIZE * model.head_dim * 4  # K and V, float32
    peer = SilentMidFrame(
        node_fingerprint(engine_config, model, model_dir, NodeConfig()), block_bytes
    )

    async def start_peer() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        pb_grpc.add_PrefillServiceServicer_to_server(peer, server)
        await server.start()
        return server, port

    server, port = run(start_peer())
    node = DecodeNode(
        engine_config,
        model_dir,
        NodeConfig(prefill_addresses=(f"127.0.0.1:{port}",), probe_cap_s=1.0),
    )
    threads = torch.get_num_threads()
    try:
        run(node.start())
        wait_until(lambda: node.health()[0], "the prefill probe")
        loader = node.engine_thread.engine.connector
        assert isinstance(loader, KVLoader) and loader.block_bytes == block_bytes
        yield Rig(node, peer, loader, model_dir, loop, server, f"127.0.0.1:{port}")
    finally:
        run(node.stop())
        run(server.stop(0))
        for sock in peer.sockets:
            sock.close()
        torch.set_num_threads(threads)


def test_abort_mid_frame_delays_other_streams_by_at_most_one_step(rig: Rig) -> None:
    node, peer, loader = rig.node, rig.peer, rig.loader
    engine = node.engine_thread.engine
    steady, victim = Stream(), Stream()
    long = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)
    local = RequestOptions(allow_split=False)
    node.submit("steady", [5, 6, 7, 8], long, record(steady, node), local).result(10)
    wait_until(lambda: len(steady.steps) >= 3, "the steady stream")
    prompt = [3 + i % 200 for i in range(40)]  # 3 blocks, split to the silent prefill
    node.submit("victim", prompt, SamplingParams(max_tokens=8), record(victim, node))
    wait_until(lambda: loader.store.stats().entries == 1 and peer.unique_key != "", "a frame")
    wait_until(lambda: (p := loader.store.progress(peer.unique_key)) and p.writing, "writing")

    node.abort("victim")
    victim.done.wait(10)
    assert victim.last is not None and victim.last.finished
    aborted_at = victim.steps[-1]
    # Three more steps of the other stream, with the frame still in the air.
    wait_until(lambda: steady.steps[-1] >= aborted_at + 3, "three more steady steps")
    after = [s for s in steady.steps if s > aborted_at][:3]
    assert after == [aborted_at + 1, aborted_at + 2, aborted_at + 3]  # one token per step
    assert "victim" in engine.scheduler.held  # its blocks are not reused under the frame
    assert loader.store.stats().entries == 1  # the frame is still being written

    for sock in peer.sockets:  # prefill dies mid-frame: the frame fails, blocks return
        sock.close()
    wait_until(lambda: "victim" not in engine.scheduler.held, "the blocks' release")
    assert loader.store.stats().entries == 0
    node.abort("steady")
    steady.done.wait(10)
    wait_until(lambda: engine.pool.num_free == engine.num_blocks, "every block free")


def test_a_prefill_failing_mid_frame_is_computed_here_once_the_frame_is_out(rig: Rig) -> None:
    """The prefill call fails (UNAVAILABLE) while its frame is still being written into the
    request's blocks: decode waits for the writer to be out, never computing under it, then
    computes the prompt itself; the tokens are the colocated engine's and it counts as
    `not_split{prefill_failed}`."""
    node, peer, loader = rig.node, rig.peer, rig.loader
    engine = node.engine_thread.engine
    prompt = [3 + i % 200 for i in range(40)]  # 3 blocks, split to the silent prefill
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    victim = Stream()
    node.submit("victim", prompt, params, record(victim, node))
    wait_until(lambda: (p := loader.store.progress(peer.unique_key)) and p.writing, "writing")
    rig.loop.call_soon_threadsafe(peer.fail_call.set)
    wait_until(lambda: loader.failures.get("peer_unavailable", 0) == 1, "the call's failure")
    time.sleep(0.3)  # engine turns pass: the prompt must not be computed under the frame
    assert victim.last is None and loader.not_split.get("prefill_failed", 0) == 0
    for sock in peer.sockets:  # the writer is out: the frame fails, its blocks are free to use
        sock.close()
    assert victim.done.wait(30)
    assert victim.last is not None and victim.last.failure is None
    expected = make_engine(rig.model_dir).generate([prompt], params)[0].token_ids
    assert victim.last.token_ids == expected and not victim.last.remote_prefill
    assert loader.not_split.get("prefill_failed") == 1
    wait_until(lambda: engine.pool.num_free == engine.num_blocks, "every block free")


def test_a_migrated_streams_fetch_cut_by_its_stopping_source_is_computed_here(rig: Rig) -> None:
    """A stream another decode paused for a drain (a live migration): while its KV is fetched
    from there, that node stops and ends the call CANCELLED (its sender's "cancelled before
    sending", as a source stopped mid-fetch by a rolling restart answered; not this stream's
    own cancel) with a frame still being written here. The stream goes on from its tokens,
    computed here once the writer is out, with the undisturbed run's tokens; counted as a
    failed migration."""
    node, peer, loader = rig.node, rig.peer, rig.loader
    engine = node.engine_thread.engine
    prompt = [3 + i % 200 for i in range(40)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    whole = make_engine(rig.model_dir).generate([prompt], params)[0].token_ids
    resume = Resume(tuple(whole[:5]), 0, Migration(rig.address, "paused-there"))
    moved = Stream()
    node.submit("moved", prompt, params, record(moved, node), RequestOptions(resume=resume))
    wait_until(lambda: (p := loader.store.progress(peer.unique_key)) and p.writing, "writing")
    peer.fail_with = (grpc.StatusCode.CANCELLED, "cancelled before sending (stage: sending)")
    rig.loop.call_soon_threadsafe(peer.fail_call.set)
    wait_until(lambda: loader.migrations.get("failed", 0) == 1, "the fetch's failure")
    for sock in peer.sockets:  # the writer is out: the stream is computed here
        sock.close()
    assert moved.done.wait(30)
    assert moved.last is not None and moved.last.failure is None, moved.last
    assert moved.last.token_ids == whole
    wait_until(lambda: engine.pool.num_free == engine.num_blocks, "every block free")
