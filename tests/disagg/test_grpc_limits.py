"""gRPC input limits on a real decode node (tiny random model, in process): a text prompt too
long for the context is refused INVALID_ARGUMENT before it is tokenized, a message beyond the
protocol's size is refused RESOURCE_EXHAUSTED, text prompts are tokenized off the engine
thread and the event loop, and the node keeps serving."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, NodeConfig
from pdserve.disagg.decode_server import DecodeNode
from pdserve.disagg.proto import pdserve_pb2 as pb
from tests.disagg.cluster import decode_stub, free_port
from tests.helpers import encode_threads, make_tiny_model


def test_grpc_prompt_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = make_tiny_model(tmp_path / "tiny")
    threads = encode_threads(monkeypatch)
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, name="node-loop", daemon=True)
    loop_thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)  # noqa: E731
    config = EngineConfig(dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=32))
    node = DecodeNode(
        config,
        model_dir,
        NodeConfig(prefill_addresses=(f"127.0.0.1:{free_port()}",), min_prompt_tokens=10_000),
    )
    torch_threads = torch.get_num_threads()
    try:
        run(node.start())
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
    finally:
        run(node.stop())
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(5)
        torch.set_num_threads(torch_threads)
