"""Fuzzing every field of the gRPC messages a node receives, with hypothesis, over a real gRPC
server (an in-process decode node on a tiny random model; prompts run there): timeouts and
deadlines (inf, NaN, huge, negative), ids (long), token ids and counts (beyond int32 on our
side, out of the vocabulary), floats (NaN, inf) and lists (long). Every call ends OK or with a
status that names the caller's mistake (INVALID_ARGUMENT, ALREADY_EXISTS, ...), never INTERNAL
or UNKNOWN, and the node holds nothing afterwards. Examples are bounded to keep the suite
short."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.disagg.decode_server import DecodeNode
from pdserve.disagg.proto import pdserve_pb2 as pb
from tests.disagg.cluster import decode_stub, inprocess_decode

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
