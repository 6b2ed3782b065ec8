"""Failure scenarios with real processes. Each ends with the invariants: every block free on
both nodes, resource store and side channel empty, no per-request task left."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.engine.sequence import SamplingParams
from tests.disagg.cluster import (
    NodeProcess,
    assert_clean,
    call_in_thread,
    decode_stub,
    free_port,
    generate,
    nodes,
    prefill_stub,
    start_pair,
)
from tests.helpers import make_engine, make_tiny_model

pytestmark = pytest.mark.slow

PROMPT = [3 + i for i in range(100)]  # 100 tokens: split to prefill
SLOW = ["--testing-transfer-delay-ms", "100"]  # 30 layer writes: ~3 s per transfer
BACKENDS = pytest.mark.parametrize("backend", ["tcp", "nixl"])  # the same promises on each


@BACKENDS
@pytest.mark.parametrize("on_failure", ["local", "fail"])
def test_prefill_killed_mid_transfer_costs_no_request_and_decode_recovers(
    backend: str, on_failure: str, tiny30: Path
) -> None:
    """By default (`--prefill-failure local`) decode computes the prompt itself when its
    prefill node dies mid-transfer: the request completes within 2 s of the kill, its tokens
    those of the colocated engine, counted as not split. With `fail` it fails as fast, naming
    the peer and the stage. Either way nothing is left held, and a prefill node that comes back
    on the same port is used again."""
    prefill, decode = start_pair(
        prefill_args=SLOW,
        decode_args=["--prefill-failure", on_failure],
        backend=backend,
        model=tiny30,
    )
    replacement = None
    with nodes(prefill, decode):
        d = decode_stub(decode.address)
        before = d.GetStats(pb.StatsRequest()).not_split
        t, box = call_in_thread(d, PROMPT)
        time.sleep(1.5)  # the prefill is pushing layers now
        killed_at = time.monotonic()
        prefill.kill()
        t.join(10)
        assert float(box["at"]) - killed_at < 2.0  # type: ignore[arg-type]
        if on_failure == "local":
            assert box.get("tokens") == colocated_tokens(tiny30), box
            assert d.GetStats(pb.StatsRequest()).not_split == before + 1
        else:
            err = box.get("error")
            assert isinstance(err, grpc.RpcError), box
            assert prefill.address in err.details() and "stage" in err.details()
            assert d.GetStats(pb.StatsRequest()).not_split == before
        assert_clean(d, None)
        replacement = NodeProcess(
            "prefill",
            ["--transfer-backend", backend, "--kv-checksum"],
            port=prefill.port,
            model=tiny30,
        )
        try:
            replacement.wait_ready()
            deadline = time.monotonic() + 10
            remote, attempt = False, 0
            while not remote and time.monotonic() < deadline:
                # A prompt decode has not cached (one it has is finished here: short_suffix).
                attempt += 1
                fresh = [3 + (i * 7 + attempt) % 250 for i in range(100)]
                tokens, remote = generate(d, fresh, 4)
                assert len(tokens) == 4
            assert remote, "decode never used the prefill node again"
            assert_clean(d, prefill_stub(replacement.address))
        finally:
            replacement.stop()


def colocated_tokens(model: Path) -> list[int]:
    """`call_in_thread`'s request (8 greedy tokens of PROMPT) on a colocated engine."""
    engine = make_engine(model)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return list(engine.generate([PROMPT], params)[0].token_ids)


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def slow_pair(request, tiny30):  # type: ignore[no-untyped-def]
    prefill, decode = start_pair(prefill_args=SLOW, backend=request.param, model=tiny30)
    with nodes(prefill, decode):
        yield decode_stub(decode.address), prefill_stub(prefill.address)


def test_client_cancel_mid_prefill_frees_both_nodes_within_1s(slow_pair) -> None:  # type: ignore[no-untyped-def]
    d, p = slow_pair
    request = pb.GenerateRequest(
        token_ids=PROMPT, sampling=pb.SamplingConfig(max_tokens=8, temperature=0.0)
    )
    call = d.Generate(request)
    deadline = time.monotonic() + 5
    busy = p.GetStats(pb.StatsRequest())
    while busy.pending_tasks == 0 and time.monotonic() < deadline:  # until prefill has it
        time.sleep(0.05)
        busy = p.GetStats(pb.StatsRequest())
    assert busy.pending_tasks == 1 and busy.num_free_blocks < busy.num_blocks  # mid-transfer
    time.sleep(0.5)
    call.cancel()
    assert_clean(d, p, within_s=1.0)


def test_deadline_names_the_stage(slow_pair) -> None:  # type: ignore[no-untyped-def]
    d, p = slow_pair
    with pytest.raises(grpc.RpcError) as e:
        generate(d, PROMPT, 8, timeout_s=1.0)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "stage" in e.value.details() and "deadline" in e.value.details().lower()
    assert_clean(d, p)


def wait_threads_at_most(stub, baseline: int) -> int:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 5
    threads = stub.GetStats(pb.StatsRequest()).threads
    while threads > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
        threads = stub.GetStats(pb.StatsRequest()).threads
    return int(threads)


def test_bad_inputs_fail_alone_with_invalid_argument(slow_pair) -> None:  # type: ignore[no-untyped-def]
    d, p = slow_pair
    baseline = (d.GetStats(pb.StatsRequest()).threads, p.GetStats(pb.StatsRequest()).threads)
    t, box = call_in_thread(d, PROMPT)  # a good request, in flight throughout
    bad_requests = [
        pb.GenerateRequest(
            token_ids=PROMPT, sampling=pb.SamplingConfig(max_tokens=4, temperature=float("nan"))
        ),
        pb.GenerateRequest(token_ids=[10**6, 5, 6], sampling=pb.SamplingConfig(max_tokens=4)),
    ]
    for request in bad_requests:
        with pytest.raises(grpc.RpcError) as e:
            list(d.Generate(request, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        p.Prefill(
            pb.PrefillRequest(
                request_id="bad-address",
                unique_key="bad-address-1",
                token_ids=PROMPT[:16],
                target_block_ids=[0],
                decode_transfer_address="nowhere",
                deadline_unix=time.time() + 10,
            ),
            timeout=10,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nowhere" in e.value.details()
    t.join(30)
    assert "tokens" in box and len(box["tokens"]) == 8, box  # type: ignore[arg-type]
    assert_clean(d, p)
    assert wait_threads_at_most(d, baseline[0]) <= baseline[0]
    assert wait_threads_at_most(p, baseline[1]) <= baseline[1]


@BACKENDS
def test_prefill_stalled_mid_transfer_fails_by_the_deadline_and_recovers(
    backend: str, tiny30: Path
) -> None:
    prefill, decode = start_pair(prefill_args=SLOW, backend=backend, model=tiny30)
    with nodes(prefill, decode):
        d, p = decode_stub(decode.address), prefill_stub(prefill.address)
        t, box = call_in_thread(d, PROMPT, timeout_s=3.0)
        start = time.monotonic()
        time.sleep(1.0)  # prefill is pushing layers
        prefill.proc.send_signal(signal.SIGSTOP)
        try:
            t.join(10)
            err = box.get("error")
            assert isinstance(err, grpc.RpcError), box
            assert float(box["at"]) - start < 3.0 + 1.0  # type: ignore[arg-type]
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.details()
            assert prefill.address in err.details() and "stage" in err.details()
            assert_clean(d, None)  # decode's blocks are free while prefill is still stopped
        finally:
            prefill.proc.send_signal(signal.SIGCONT)
        tokens, remote = generate(d, PROMPT, 4)
        assert len(tokens) == 4 and remote
        assert_clean(d, p)


@BACKENDS
def test_decode_stalled_while_prefill_sends_frees_prefill_by_the_deadline(
    backend: str, tiny30: Path
) -> None:
    prefill, decode = start_pair(prefill_args=SLOW, backend=backend, model=tiny30)
    with nodes(prefill, decode):
        d, p = decode_stub(decode.address), prefill_stub(prefill.address)
        t, box = call_in_thread(d, PROMPT, timeout_s=3.0)
        deadline = time.monotonic() + 5
        while p.GetStats(pb.StatsRequest()).pending_tasks == 0:  # prefill has the request
            assert time.monotonic() < deadline
            time.sleep(0.02)
        start = time.monotonic()
        decode.proc.send_signal(signal.SIGSTOP)
        try:
            freed = None
            while time.monotonic() - start < 3.0 + 3.0:
                stats = p.GetStats(pb.StatsRequest())
                if stats.pending_tasks == 0 and stats.num_free_blocks == stats.num_blocks:
                    freed = time.monotonic() - start
                    break
                time.sleep(0.05)
            assert freed is not None and freed < 3.0 + 1.0, freed
        finally:
            decode.proc.send_signal(signal.SIGCONT)
        t.join(15)
        assert isinstance(box.get("error"), grpc.RpcError), box
        assert_clean(d, p)


def test_overloaded_prefill_means_the_prompt_is_prefilled_on_decode_and_counted(
    tiny30: Path,
) -> None:
    prefill, decode = start_pair(prefill_args=[*SLOW, "--max-concurrent-rpcs", "1"], model=tiny30)
    with nodes(prefill, decode):
        d = decode_stub(decode.address)
        before = d.GetStats(pb.StatsRequest()).not_split
        with ThreadPoolExecutor(3) as pool:  # one holds prefill's only call slot for ~3 s
            results = list(pool.map(lambda _: generate(d, PROMPT, 6), range(3)))
        remote = [r for _, r in results]
        assert any(remote) and not all(remote), remote  # the overflow ran on decode
        assert len({tuple(tokens) for tokens, _ in results}) == 1  # same answer either way
        assert d.GetStats(pb.StatsRequest()).not_split >= before + remote.count(False)
        assert_clean(d, prefill_stub(prefill.address))


@pytest.mark.parametrize("on_failure", ["local", "fail"])
def test_unreachable_prefill_costs_at_most_the_probe_cap(on_failure: str, tiny30: Path) -> None:
    """With no prefill node to reach, decode computes the prompt itself after the probe cap
    (`--prefill-failure local`, the default) or fails naming the node (`fail`)."""
    nobody = f"127.0.0.1:{free_port()}"
    args = ["--prefill", nobody, "--probe-cap", "0.5", "--prefill-failure", on_failure]
    decode = NodeProcess("decode", args, model=tiny30)
    expected = colocated_tokens(tiny30)
    with nodes(decode):
        d = decode_stub(decode.address)
        start = time.monotonic()
        if on_failure == "local":
            tokens, remote = generate(d, PROMPT, 8)
            assert tokens == expected and not remote
        else:
            with pytest.raises(grpc.RpcError) as e:
                generate(d, PROMPT, 4)
            assert nobody in e.value.details() and "unreachable" in e.value.details()
        assert time.monotonic() - start < 0.5 + 1.0
        assert_clean(d, None)


def test_a_transfer_backend_mismatch_is_refused_naming_both_sides(tiny30: Path) -> None:
    prefill = NodeProcess("prefill", ["--transfer-backend", "nixl"], model=tiny30)
    decode = NodeProcess("decode", ["--prefill", prefill.address], model=tiny30)
    with nodes(prefill, decode):
        d = decode_stub(decode.address)
        with pytest.raises(grpc.RpcError) as e:
            generate(d, PROMPT, 4)
        assert "transfer_backend: decode='tcp' prefill='nixl'" in e.value.details()
        assert_clean(d, prefill_stub(prefill.address))


def test_model_fingerprint_mismatch_is_refused_naming_both_sides(tiny30: Path) -> None:
    prefill, decode = start_pair(prefill_args=["--block-size", "32"], model=tiny30)
    with nodes(prefill, decode):
        d = decode_stub(decode.address)
        with pytest.raises(grpc.RpcError) as e:
            generate(d, PROMPT, 4)
        assert "block_size: decode=16 prefill=32" in e.value.details()
        assert_clean(d, prefill_stub(prefill.address))


def test_sigterm_fails_requests_in_flight_clearly_and_exits(tiny30: Path) -> None:
    prefill, decode = start_pair(prefill_args=SLOW, model=tiny30)
    with nodes(prefill, decode):
        d = decode_stub(decode.address)
        t, box = call_in_thread(d, PROMPT)
        time.sleep(1.0)
        decode.proc.terminate()
        t.join(15)
        err = box.get("error")
        assert isinstance(err, grpc.RpcError), box
        assert "shutting down" in (err.details() or "")
        assert decode.proc.wait(15) == 0
        p = prefill_stub(prefill.address)
        deadline = time.monotonic() + 5
        while p.GetStats(pb.StatsRequest()).pending_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = p.GetStats(pb.StatsRequest())
        assert stats.pending_tasks == 0 and stats.num_free_blocks == stats.num_blocks


def test_stop_is_safe_when_nothing_started(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from pdserve.config import EngineConfig, NodeConfig
    from pdserve.serve.decode_node import DecodeNode
    from pdserve.serve.prefill_node import PrefillNode

    async def stop_both() -> None:
        await PrefillNode(EngineConfig(), tmp_path, NodeConfig()).stop()
        await DecodeNode(EngineConfig(), tmp_path, NodeConfig(prefill_addresses=("x:1",))).stop()

    asyncio.run(stop_both())


def test_a_quantization_mismatch_is_named_by_the_fingerprint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pdserve.config import ModelConfig
    from pdserve.disagg.wire import NodeTerms, fingerprint, fingerprint_mismatch

    model = ModelConfig.from_dir(make_tiny_model(tmp_path / "tiny"))
    decode, prefill = (
        fingerprint(model, NodeTerms("bfloat16", 16, q, "tcp")) for q in ("none", "int4")
    )
    assert fingerprint_mismatch(decode, decode) is None
    assert "quantization: decode='none' prefill='int4'" in (
        fingerprint_mismatch(decode, prefill) or ""
    )
