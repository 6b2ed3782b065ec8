"""Fuzzing every field of the gRPC messages a node receives, with hypothesis, over real gRPC
servers (in-process nodes on a tiny random model: a decode running its prompts itself, and a
prefill with a decode registered by its probe, for `PrefillRequest`): timeouts and
deadlines (inf, NaN, huge, negative), ids (long), token ids and counts (beyond int32 on our
side, out of the vocabulary), floats (NaN, inf) and lists (long). Every call ends OK or with a
status that names the caller's mistake (INVALID_ARGUMENT, ALREADY_EXISTS, ...), never INTERNAL
or UNKNOWN, and the node holds nothing afterwards. Examples are bounded to keep the suite
short (the prefill node may also answer ABORTED: frames for keys the decode never
registered are refused there)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.config import CacheConfig, EngineConfig, NodeConfig
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.serve.decode_node import DecodeNode
from pdserve.serve.prefill_node import PrefillNode
from tests.disagg.cluster import decode_stub, inprocess_decode, prefill_stub
from tests.helpers import make_tiny_model

pytestmark = pytest.mark.slow

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
DOUBLES = st.floats(allow_nan=True, allow_infinity=True)
CALLERS_MISTAKES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}

sampling = st.builds(
    pb.SamplingConfig,
    max_tokens=st.one_of(st.integers(-2, 6), INT32),
    temperature=FLOATS,
    top_p=FLOATS,
    top_k=st.one_of(st.integers(-2, 50), INT32),
    has_seed=st.booleans(),
    seed=INT64,
    stop=st.lists(st.text(max_size=300), max_size=6),
    stop_token_ids=st.lists(INT32, max_size=8),
    ignore_eos=st.booleans(),
    logprobs=st.booleans(),
    top_logprobs=st.one_of(st.integers(-1, 25), INT32),
    presence_penalty=DOUBLES,
    frequency_penalty=DOUBLES,
    repetition_penalty=DOUBLES,
    min_tokens=st.one_of(st.integers(-1, 8), INT32),
    logit_bias=st.lists(st.builds(pb.LogitBias, token=INT32, bias=DOUBLES), max_size=4),
    guide_kind=st.sampled_from(["", "regex", "choice", "json_schema", "nonsense"]),
    guide_spec=st.text(max_size=40),
)
generate_requests = st.builds(
    pb.GenerateRequest,
    request_id=st.one_of(st.just(""), st.text(max_size=300)),
    token_ids=st.lists(st.one_of(st.integers(0, 255), INT32), min_size=0, max_size=12),
    prompt=st.one_of(st.just(""), st.text(max_size=40)),
    sampling=sampling,
    timeout_s=st.one_of(st.just(0.0), st.just(30.0), FLOATS),
)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DecodeNode]:
    with inprocess_decode(Path(tmp_path_factory.mktemp("fuzz"))) as n:
        yield n


def test_generate_fields_never_fail_the_node(node: DecodeNode) -> None:
    assert node.grpc is not None
    stub = decode_stub(node.grpc.address)

    @settings(
        max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(request=generate_requests)
    def fuzz(request: pb.GenerateRequest) -> None:
        if request.sampling.max_tokens > 8:  # a valid huge one would run long: bounded here
            request.sampling.max_tokens = 8
        try:
            for _ in stub.Generate(request, timeout=30):
                pass
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
            assert code in CALLERS_MISTAKES, (code, e.details(), request)
            assert "Traceback" not in (e.details() or "")

    fuzz()
    deadline = time.monotonic() + 10
    while (snap := node.snapshot()).kv_blocks_used or snap.num_requests_running:
        assert time.monotonic() < deadline, f"the node still holds requests or blocks: {snap}"
        time.sleep(0.05)


prefill_requests = st.builds(
    pb.PrefillRequest,
    request_id=st.text(max_size=300),
    unique_key=st.text(max_size=300),
    token_ids=st.lists(st.one_of(st.integers(0, 255), INT32), max_size=40),
    sampling=sampling,
    decode_transfer_address=st.sampled_from(["", "registered", "10.9.9.9:1", "nonsense"]),
    target_block_ids=st.lists(st.one_of(st.integers(0, 40), INT32), max_size=4),
    cached_block_keys=st.lists(st.binary(max_size=20), max_size=3),
    deadline_unix=st.one_of(st.just(0.0), st.just(-1.0), DOUBLES, st.just(10.0)),
    decode_kv_head_bounds=st.lists(st.one_of(st.integers(-1, 3), INT32), max_size=4),
    cache_salt=st.text(max_size=300),
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PrefillNode, DecodeNode]]:
    """A prefill and a decode node in this process (tiny random model, in-process transfer),
    the decode registered with the prefill by its probe."""
    model = make_tiny_model(Path(tmp_path_factory.mktemp("fuzz-pair")) / "tiny")
    config = EngineConfig(dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=64))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(120)  # noqa: E731
    threads = torch.get_num_threads()
    prefill = PrefillNode(config, model, NodeConfig(transfer_backend="inprocess"))
    run(prefill.start())
    assert prefill.grpc is not None
    decode = DecodeNode(
        config,
        model,
        NodeConfig(
            transfer_backend="inprocess",
            prefill_addresses=(prefill.grpc.address,),
            min_prompt_tokens=1,
        ),
    )
    run(decode.start())
    try:
        yield prefill, decode
    finally:
        run(decode.stop())
        run(prefill.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        torch.set_num_threads(threads)


def test_prefill_fields_never_fail_the_node(pair: tuple[PrefillNode, DecodeNode]) -> None:
    prefill, decode = pair
    assert prefill.grpc is not None
    stub = prefill_stub(prefill.grpc.address)
    allowed = CALLERS_MISTAKES | {grpc.StatusCode.ABORTED}  # frames the decode refused

    @settings(
        max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(request=prefill_requests)
    def fuzz(request: pb.PrefillRequest) -> None:
        if request.decode_transfer_address == "registered":
            request.decode_transfer_address = decode.transfer_address
        if request.deadline_unix == 10.0:
            request.deadline_unix = time.time() + 10
        try:
            stub.Prefill(request, timeout=30)
        except grpc.RpcError as e:
            assert e.code() in allowed, (e.code(), e.details(), request)
            assert "Traceback" not in (e.details() or "")

    fuzz()
    deadline = time.monotonic() + 15
    while (snap := prefill.snapshot()).kv_blocks_used or snap.held_for_send:
        assert time.monotonic() < deadline, f"the prefill node still holds blocks: {snap}"
        time.sleep(0.05)
