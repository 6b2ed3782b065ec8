"""Disaggregation between tensor-parallel nodes sharded differently: a prefill node with P ranks
feeding a decode node with D ranks (tiny random Llama, fp32, 8 attention heads) generates the
tokens of the colocated single-rank engine, and the KV of every prompt crosses the wire exactly
once per head (decode's received-bytes counter against the prompt's size; prefill's sent bytes
exceed it by frame headers only). Heads split on both sides, merged (P=2 -> D=1), split further
(P=1 -> D=2) and replicated (fewer KV heads than decode ranks: received once, copied to each
rank that holds them). A rank of either node killed mid-transfer fails the request within 2 s
and leaves both nodes clean."""

from __future__ import annotations

import functools
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from pdserve.config import EngineConfig
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from tests.disagg.cluster import (
    assert_clean,
    call_in_thread,
    decode_stub,
    generate,
    nodes,
    prefill_stub,
    start_pair,
    worker_pids,
)
from tests.helpers import make_tiny_model

pytestmark = pytest.mark.slow

LAYERS, HEAD_DIM, BLOCK = 3, 8, 16  # the tiny model's (hidden 64 / 8 heads) and the nodes'
PROMPTS = [[3 + (13 * i + 5 * j) % 250 for j in range(9 + 23 * i)] for i in range(8)]
MAX_TOKENS = 16


CASES = {  # KV heads: (prefill TP, decode TP, backend)
    # merged on decode, split further, split alike; over NIXL, a head slice of decode's blocks
    # read from a whole prefill rank, and whole blocks of both sides' second ranks
    4: [(2, 1, "tcp"), (1, 2, "tcp"), (2, 2, "tcp"), (2, 1, "nixl"), (2, 2, "nixl")],
    2: [(1, 4, "tcp")],  # decode ranks replicate each KV head
}


@pytest.fixture(scope="module", params=sorted(CASES), ids=lambda n: f"{n}-kv-heads")
def model(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[Path, int]:
    heads = request.param
    path = make_tiny_model(
        tmp_path_factory.mktemp("tiny-tp-disagg"),
        num_attention_heads=8,
        num_key_value_heads=heads,
        num_hidden_layers=LAYERS,
    )
    return path, heads


@pytest.fixture(scope="module")
def reference(model: tuple[Path, int]) -> list[list[int]]:
    """Greedy tokens of the colocated single-rank engine."""
    engine = LLMEngine(EngineConfig(dtype="float32", num_threads=1), model[0])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in engine.generate(PROMPTS, params)]


def expected_ranks(heads: int, tp: int) -> list[tuple[int, int]]:
    """(first KV head, count) per rank: split when the ranks divide the heads, else each head
    replicated over tp/heads ranks."""
    if heads >= tp:
        return [(r * heads // tp, heads // tp) for r in range(tp)]
    return [(r // (tp // heads), 1) for r in range(tp)]


def test_any_prefill_tp_to_any_decode_tp_is_token_identical(
    model: tuple[Path, int], reference: list[list[int]]
) -> None:
    path, heads = model
    for p, d, backend in CASES[heads]:
        prefill, decode = start_pair(["-tp", str(p)], ["-tp", str(d)], model=path, backend=backend)
        with nodes(prefill, decode):
            dstub, pstub = decode_stub(decode.address), prefill_stub(prefill.address)
            info = pstub.GetPeerInfo(pb.PeerInfoRequest(), timeout=5)
            assert info.tp_size == p
            ranks = [(r.head_start, r.head_count) for r in info.kv_ranks]
            assert ranks == expected_ranks(heads, p)
            before_d = dstub.GetStats(pb.StatsRequest(), timeout=5).bytes_received
            before_p = pstub.GetStats(pb.StatsRequest(), timeout=5).bytes_sent
            with ThreadPoolExecutor(4) as pool:
                run = functools.partial(generate, dstub, max_tokens=MAX_TOKENS)
                results = list(pool.map(run, PROMPTS))
            where = f"P-TP={p} D-TP={d} over {backend}"
            assert [tokens for tokens, _ in results] == reference, where
            assert all(remote for _, remote in results), where
            # Each prompt's KV once: every block of every layer, K and V of every head.
            blocks = sum(-(-len(ids) // BLOCK) for ids in PROMPTS)
            prompt_kv = blocks * LAYERS * 2 * heads * BLOCK * HEAD_DIM * 4  # fp32
            received = dstub.GetStats(pb.StatsRequest(), timeout=5).bytes_received - before_d
            sent = pstub.GetStats(pb.StatsRequest(), timeout=5).bytes_sent - before_p
            assert received == prompt_kv, where
            frames = len(PROMPTS) * LAYERS * (p + d)  # at most p + d head slices per layer
            assert prompt_kv <= sent < prompt_kv + frames * 256, where  # the rest: headers
            assert_clean(dstub, pstub)


PROMPT = [3 + i for i in range(100)]  # 7 blocks: split to prefill


def tiny30(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's 30 layers (so slow writes pace a transfer) on a tiny random model."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny30-tp"),
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=30,
    )


def test_a_prefill_rank_killed_mid_transfer_fails_the_request_fast_and_all_ends_clean(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Prefill TP=2 -> decode TP=1 with slow writes (30 layers, 2 frames each, 50 ms per write:
    ~3 s of transfer): rank 1 of prefill dies while its heads are being sent. With
    `--prefill-failure fail` the request fails within 2 s naming prefill and the stage (by
    default decode would compute it: tests/disagg/test_failures.py); both nodes hold nothing;
    prefill's other rank is gone and prefill answers UNAVAILABLE naming the rank; decode then
    serves on its own."""
    model = tiny30(tmp_path_factory)
    slow = ["--testing-transfer-delay-ms", "50"]
    prefill, decode = start_pair(["-tp", "2", *slow], ["--prefill-failure", "fail"], model=model)
    with nodes(prefill, decode):
        dstub, pstub = decode_stub(decode.address), prefill_stub(prefill.address)
        [rank1] = worker_pids(prefill.proc.pid)
        caller, box = call_in_thread(dstub, PROMPT)
        deadline = time.monotonic() + 10
        while pstub.GetStats(pb.StatsRequest(), timeout=5).held_for_send == 0:
            assert time.monotonic() < deadline, "prefill never started sending"
            time.sleep(0.02)
        os.kill(rank1, signal.SIGKILL)  # mid-transfer: computed, layers still going out
        killed_at = time.monotonic()
        caller.join(10)
        err = box.get("error")
        assert isinstance(err, grpc.RpcError), box
        assert float(box["at"]) - killed_at < 2.0  # type: ignore[arg-type]
        assert prefill.address in err.details() and "stage" in err.details(), err.details()
        assert_clean(dstub, pstub)
        assert worker_pids(prefill.proc.pid) == []  # no rank left waiting in a collective
        with pytest.raises(grpc.RpcError) as probe:
            pstub.GetPeerInfo(pb.PeerInfoRequest(), timeout=5)
        assert probe.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "rank 1 died" in (probe.value.details() or "")
        # Decode marks prefill failed once a call to it fails UNAVAILABLE (the first call's
        # answer may still be on its way): from then on it prefills itself.
        deadline = time.monotonic() + 10
        while True:
            try:
                tokens, remote = generate(dstub, PROMPT, 8)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
        assert len(tokens) == 8 and not remote
        assert_clean(dstub, None)


def test_a_decode_rank_killed_while_receiving_fails_the_request_and_frees_both_nodes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Prefill TP=1 -> decode TP=2 with slow writes: decode's rank 1 dies while its heads
    arrive. The request fails within 2 s naming the rank; prefill's blocks come back (its
    remaining frames are refused), decode holds nothing, and no decode worker is left."""
    model = tiny30(tmp_path_factory)
    prefill, decode = start_pair(["--testing-transfer-delay-ms", "50"], ["-tp", "2"], model=model)
    with nodes(prefill, decode):
        dstub, pstub = decode_stub(decode.address), prefill_stub(prefill.address)
        [rank1] = worker_pids(decode.proc.pid)
        caller, box = call_in_thread(dstub, PROMPT)
        deadline = time.monotonic() + 10
        while dstub.GetStats(pb.StatsRequest(), timeout=5).bytes_received == 0:
            assert time.monotonic() < deadline, "no KV arrived"
            time.sleep(0.02)
        os.kill(rank1, signal.SIGKILL)  # mid-transfer: some layers in, more coming
        killed_at = time.monotonic()
        caller.join(10)
        err = box.get("error")
        assert isinstance(err, grpc.RpcError), box
        assert float(box["at"]) - killed_at < 2.0  # type: ignore[arg-type]
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "rank 1 died" in (err.details() or ""), err.details()
        assert_clean(dstub, pstub)
        assert worker_pids(decode.proc.pid) == []
