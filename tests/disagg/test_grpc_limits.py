"""gRPC input limits on a real decode node (tiny random model, in process): a text prompt too
long for the context is refused INVALID_ARGUMENT before it is tokenized, a message beyond the
protocol's size is refused RESOURCE_EXHAUSTED, text prompts are tokenized off the engine
thread and the event loop, and the node keeps serving. Past `--max-concurrent-rpcs` generation
calls one more is refused RESOURCE_EXHAUSTED while stats still answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.snapshot import NodeSnapshot
from pdserve.serve.decode_node import DecodeNode
from tests.disagg.cluster import decode_stub, inprocess_decode
from tests.helpers import encode_threads


@pytest.fixture
def node(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[DecodeNode]:
    with inprocess_decode(tmp_path, max_concurrent_rpcs=getattr(request, "param", 64)) as n:
        yield n


def test_grpc_prompt_limits(node: DecodeNode, monkeypatch: pytest.MonkeyPatch) -> None:
    threads = encode_threads(monkeypatch)
    assert node.grpc is not None
    d = decode_stub(node.grpc.address)
    sampling = pb.SamplingConfig(max_tokens=2, temperature=0.0, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as e:
        list(d.Generate(pb.GenerateRequest(prompt="t5 " * 1_000_000, sampling=sampling)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert threads == []  # refused before tokenizing
    with pytest.raises(grpc.RpcError) as e:
        list(d.Generate(pb.GenerateRequest(prompt="x" * (5 << 20), sampling=sampling)))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    tokens = [t for r in d.Generate(pb.GenerateRequest(prompt="t5 t6 t7", sampling=sampling))
              for t in r.token_ids]  # fmt: skip
    assert len(tokens) == 2
    assert threads and not {"node-loop", "decode-engine"} & set(threads)


@pytest.mark.parametrize("node", [1], indirect=True)
def test_generation_calls_past_the_limit_are_refused_and_control_calls_answer(
    node: DecodeNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert node.grpc is not None
    d = decode_stub(node.grpc.address)
    # The held request must still be in the engine when stats are read: the tiny model would
    # decode all its tokens in well under a second, so once it has streamed its first token the
    # engine's next steps wait for the test (the RPC limiter under test never sees this).
    engine, release, started = node.engine_thread.engine, threading.Event(), threading.Event()
    step = engine.run_step

    def gated_step() -> list[RequestOutput]:
        if started.is_set():
            release.wait(30)
        outs = step()
        if outs:
            started.set()
        return outs

    monkeypatch.setattr(engine, "run_step", gated_step)
    # Stats include what a client already received: the snapshot of the turn that produced
    # the first token is published before that token is handed over, however late the engine
    # thread gets to it (slowed here; on a loaded CI host the read once came first, 0 != 1).
    take_snapshot = node.engine_thread._take_snapshot

    def late_snapshot() -> NodeSnapshot:
        time.sleep(0.3)
        return take_snapshot()

    monkeypatch.setattr(node.engine_thread, "_take_snapshot", late_snapshot)
    long = pb.SamplingConfig(max_tokens=400, temperature=0.0, ignore_eos=True)
    short = pb.SamplingConfig(max_tokens=2, temperature=0.0, ignore_eos=True)
    held = d.Generate(pb.GenerateRequest(token_ids=[5, 6, 7], sampling=long))
    try:
        next(held)  # the only generation slot is taken while this stream is open
        with pytest.raises(grpc.RpcError) as e:
            list(d.Generate(pb.GenerateRequest(token_ids=[5, 6, 7], sampling=short)))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 calls in progress" in (e.value.details() or "")
        assert d.GetStats(pb.StatsRequest()).num_requests == 1  # stats answer past the limit
    finally:
        release.set()
    held.cancel()  # the slot is given back once the cancelled call has ended
    deadline = time.monotonic() + 10
    while True:
        try:
            responses = list(d.Generate(pb.GenerateRequest(token_ids=[5, 6, 7], sampling=short)))
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() < deadline, "the cancelled call never gave its slot back"
            time.sleep(0.05)
    assert sum(len(r.token_ids) for r in responses) == 2


def test_a_nodes_grpc_port_is_its_own() -> None:
    """A second server on a port a node serves on fails to start (gRPC's default SO_REUSEPORT
    would let it bind and take a share of the node's connections)."""
    import asyncio

    from pdserve.config import TlsFiles
    from pdserve.disagg.grpc_server import GrpcServer

    async def both() -> None:
        first = GrpcServer("127.0.0.1", 0, 4, None, TlsFiles())
        await first.start()
        try:
            with pytest.raises(RuntimeError, match="Failed to bind"):
                GrpcServer("127.0.0.1", first.port, 4, None, TlsFiles())
        finally:
            await first.stop()

    asyncio.run(both())
