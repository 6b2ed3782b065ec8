"""Every failure reason, produced where it really happens (the resource store, the prefill client
against a real gRPC peer on loopback, the engine thread), reaches the gRPC edge (decode's
Generate) and the HTTP edge (the OpenAI app) with the status the issue specifies. The expected
statuses below are written from the specification, not read from the product's table."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

import grpc
import httpx
import pytest

from pdserve.api.grpc_entry import DecodeServicer
from pdserve.api.metrics import ServingMetrics
from pdserve.api.routes import build_app
from pdserve.config import NodeConfig
from pdserve.disagg.grpc_server import abort_with
from pdserve.disagg.prefill_client import PrefillCallError, PrefillClient, ProbePolicy
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.disagg.resource_store import KVLoadError, ResourceStore
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.failure import Failure, FailureReason, RequestFailed
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import SamplingParams
from pdserve.engine.snapshot import NodeSnapshot
from tests.disagg.cluster import free_port
from tests.helpers import make_engine, make_tiny_model

R = FailureReason
# The table: reason -> (gRPC status, HTTP status, OpenAI error code).
EXPECTED = {
    R.DEADLINE: (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout"),
    R.PEER_UNAVAILABLE: (grpc.StatusCode.UNAVAILABLE, 503, "unavailable"),
    R.INVALID_INPUT: (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request"),
    R.CANCELLED: (grpc.StatusCode.CANCELLED, 499, "cancelled"),
    R.OVERLOADED: (grpc.StatusCode.RESOURCE_EXHAUSTED, 503, "overloaded"),
}
FINGERPRINT = pb.ModelFingerprint(architecture="llama", num_layers=2, dtype="float32")


# ---- a scripted prefill peer (a real grpc.aio server on loopback) ---------------------------


class ScriptedPrefill(pb_grpc.PrefillServiceServicer):
    def __init__(self, prefill: Callable[[grpc.aio.ServicerContext], Awaitable[None]]) -> None:
        self.prefill = prefill

    async def GetPeerInfo(self, request: pb.PeerInfoRequest, context: object) -> pb.PeerInfo:
        return pb.PeerInfo(tp_size=1, fingerprint=FINGERPRINT, role="prefill")

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        await self.prefill(context)
        return pb.PrefillResponse(has_first_token=True)


async def prefill_failure(
    prefill: Callable[[grpc.aio.ServicerContext], Awaitable[None]] | None, timeout_s: float
) -> Failure:
    """Decode's prefill client calls the scripted peer (None: nobody listens); its failure."""
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0") if prefill else free_port()
    if prefill is not None:
        pb_grpc.add_PrefillServiceServicer_to_server(ScriptedPrefill(prefill), server)
        await server.start()
    client = PrefillClient([f"127.0.0.1:{port}"], FINGERPRINT, probes=ProbePolicy(cap_s=0.5))
    request = pb.PrefillRequest(
        request_id="r", unique_key="r-k", token_ids=[1, 2], deadline_unix=time.time() + timeout_s
    )
    try:
        with pytest.raises(PrefillCallError) as e:
            await client.prefill(request)
        return e.value.failure
    finally:
        await client.close()
        await server.stop(0)


def deadline_by_prefill_abort() -> Failure:
    async def prefill(context: grpc.aio.ServicerContext) -> None:
        # What prefill's own timer does when the shared deadline passes.
        failure = Failure(R.DEADLINE, "deadline passed", "prefill/transfer")
        await abort_with(context, failure, "request r (unique key r-k)")

    return asyncio.run(prefill_failure(prefill, 5.0))


def deadline_by_grpc_client() -> Failure:
    async def prefill(context: grpc.aio.ServicerContext) -> None:
        await asyncio.sleep(10)  # silent past the deadline: the client's gRPC deadline fires

    return asyncio.run(prefill_failure(prefill, 0.5))


def peer_death() -> Failure:
    return asyncio.run(prefill_failure(None, 5.0))


def deadline_by_decode_sweep() -> Failure:
    store = ResourceStore()
    store.register("k", "r", [1], 1, 2, 64, time.time() - 0.01)
    assert store.sweep() == ["k"]
    result = store.claim("k")
    assert result is not None and result.failure is not None
    return result.failure


def cancel() -> Failure:
    store = ResourceStore()
    store.register("k", "r", [1], 1, 2, 64, time.time() + 10)
    store.cancel("k")  # decode's client went away
    with pytest.raises(KVLoadError) as e:
        store.load_cache_sync("k", time.time() + 1)
    return e.value.failure


@pytest.fixture(scope="module")
def engine_thread(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    engine = make_engine(make_tiny_model(tmp_path_factory.mktemp("tiny")))
    thread = EngineThread(lambda: engine, "test-engine", max_pending=1)
    thread.build().result(60)
    thread.start()
    yield thread
    thread.stop()


def refusal(future: Future[None]) -> Failure:
    with pytest.raises(RequestFailed) as e:
        future.result(10)
    return e.value.failure


def invalid_input(thread: EngineThread) -> Failure:
    return refusal(thread.submit("bad", [9999], SamplingParams(), lambda out: None))


def overload(thread: EngineThread) -> Failure:
    long = SamplingParams(max_tokens=900, ignore_eos=True)
    thread.submit("busy", [5] * 8, long, lambda out: None).result(10)
    try:
        return refusal(thread.submit("one-too-many", [5] * 8, SamplingParams(), lambda o: None))
    finally:
        thread.abort("busy").result(10)


PRODUCERS: dict[str, tuple[Callable[..., Failure], FailureReason, bool]] = {
    # name: (produce, reason, needs the engine thread)
    "deadline: decode's sweep": (deadline_by_decode_sweep, R.DEADLINE, False),
    "deadline: prefill's own abort": (deadline_by_prefill_abort, R.DEADLINE, False),
    "deadline: the gRPC client deadline": (deadline_by_grpc_client, R.DEADLINE, False),
    "peer death": (peer_death, R.PEER_UNAVAILABLE, False),
    "invalid input": (invalid_input, R.INVALID_INPUT, True),
    "cancel": (cancel, R.CANCELLED, False),
    "overload": (overload, R.OVERLOADED, True),
}


# ---- the edges ------------------------------------------------------------------------------


class FailingNode:
    """Stands in for the engine behind the edges: its one request ends with `failure`
    (delivered as the final output, or as a refusal at admission)."""

    role = "decode"
    accepts_requests = True
    max_model_len = 1024
    reader_idle_timeout_s = 60.0
    request_timeout_s = 600.0
    tokenizer: Any = None
    config = NodeConfig()

    def __init__(self, failure: Failure, at_admission: bool) -> None:
        self.failure = failure
        self.at_admission = at_admission

    def submit(
        self, request_id: str, prompt: Any, params: Any, on_output: Any, options: Any = None
    ) -> Future[None]:
        future: Future[None] = Future()
        if self.at_admission:
            future.set_exception(RequestFailed(self.failure))
            return future
        on_output(
            RequestOutput(request_id, [1], [], "", "", [], True, "error", failure=self.failure)
        )
        future.set_result(None)
        return future

    def abort(self, request_id: str, failure: Failure | None = None) -> None:
        pass

    def snapshot(self) -> NodeSnapshot:
        return NodeSnapshot()

    def health(self) -> tuple[bool, str]:
        return True, "ok"


async def grpc_status(node: FailingNode) -> grpc.StatusCode:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    pb_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(node, ServingMetrics(), 8), server)  # type: ignore[arg-type]
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.DecodeServiceStub(channel).Generate(pb.GenerateRequest(token_ids=[1]))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            return e.value.code()
    finally:
        await server.stop(0)


async def http_status(node: FailingNode) -> tuple[int, dict[str, Any]]:
    app = build_app(node, ServingMetrics(), "m")  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        r = await client.post(
            "/v1/completions", json={"model": "m", "prompt": [1], "max_tokens": 2}
        )
        return r.status_code, r.json()


@pytest.mark.parametrize("name", list(PRODUCERS))
def test_failure_reason_reaches_its_grpc_and_http_status(name: str, request) -> None:  # type: ignore[no-untyped-def]
    produce, reason, needs_engine = PRODUCERS[name]
    failure = produce(request.getfixturevalue("engine_thread")) if needs_engine else produce()
    assert failure.reason == reason, failure
    code, status, error_code = EXPECTED[reason]
    for at_admission in (False, True):
        node = FailingNode(failure, at_admission)
        assert asyncio.run(grpc_status(node)) == code
        got_status, body = asyncio.run(http_status(node))
        assert got_status == status and body["error"]["code"] == error_code, body
        assert body["error"]["message"] == str(failure)
