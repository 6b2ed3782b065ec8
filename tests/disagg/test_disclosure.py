"""No KV crosses requests: prefill pushes only to a transfer address a decode registered (never
to one a caller names), and only the prompt's own token slots carry data, even though frames
move whole blocks. Real in-process nodes (tiny random model, TCP transport) on loopback."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, NodeConfig
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.wire import REFUSAL_METADATA, UNREGISTERED
from pdserve.serve.decode_node import DecodeNode
from pdserve.serve.prefill_node import PrefillNode
from tests.disagg.cluster import assert_clean, decode_stub, generate, prefill_stub
from tests.helpers import make_tiny_model

T = TypeVar("T")
CANARY = 0x5A5A5A5A  # a float32 bit pattern no real KV value has here (about 1.5e16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def run() -> Iterator[Callable[[Any], Any]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    threads = torch.get_num_threads()
    yield lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    torch.set_num_threads(threads)


CONFIG = EngineConfig(dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=32))


def test_prefill_refuses_an_unregistered_transfer_address_and_connects_nowhere(
    tiny: Path, run: Callable[[Any], Any]
) -> None:
    prefill = PrefillNode(CONFIG, tiny, NodeConfig())
    listener = socket.create_server(("127.0.0.1", 0))  # where an attacker wants KV pushed
    listener.settimeout(0.5)
    target = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        run(prefill.start())
        assert prefill.grpc is not None
        p = prefill_stub(prefill.grpc.address)
        p.GetPeerInfo(pb.PeerInfoRequest(decode_transfer_address="127.0.0.1:1"))  # someone else
        request = pb.PrefillRequest(
            request_id="r",
            unique_key="r-1",
            token_ids=[5, 6, 7],
            decode_transfer_address=target,
            target_block_ids=[0],
            deadline_unix=time.time() + 10,
        )
        with pytest.raises(grpc.RpcError) as e:
            p.Prefill(request)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (REFUSAL_METADATA, UNREGISTERED) in tuple(e.value.trailing_metadata())
        with pytest.raises(TimeoutError):
            listener.accept()  # prefill opened no connection to it
        assert p.GetStats(pb.StatsRequest()).transfer_links_opened == 0
    finally:
        listener.close()
        run(prefill.stop())


def test_a_short_prompt_carries_no_byte_of_an_earlier_request(
    tiny: Path, run: Callable[[Any], Any]
) -> None:
    prefill = PrefillNode(CONFIG, tiny, NodeConfig())
    decode: DecodeNode | None = None
    try:
        run(prefill.start())
        assert prefill.grpc is not None
        decode = DecodeNode(
            CONFIG,
            tiny,
            NodeConfig(prefill_addresses=(prefill.grpc.address,), min_prompt_tokens=1),
        )
        run(decode.start())
        assert decode.grpc is not None
        # An earlier request left its KV everywhere in prefill's pool: every slot a canary.
        for cache in prefill.engine_thread.engine.kv_caches:
            cache.view(torch.int32).fill_(CANARY)
        d, p = decode_stub(decode.grpc.address), prefill_stub(prefill.grpc.address)
        _, remote = generate(d, [5, 6, 7], 2)  # 3 of a block's 16 slots are the prompt's
        assert remote
        received = decode.engine_thread.engine.kv_caches
        assert sum(int((c.view(torch.int32) != 0).sum()) for c in received) > 0  # KV arrived
        leaked = sum(int((c.view(torch.int32) == CANARY).sum()) for c in received)
        assert leaked == 0, f"{leaked} canary values reached decode"
        assert_clean(d, p)
    finally:
        if decode is not None:
            run(decode.stop())
        run(prefill.stop())
