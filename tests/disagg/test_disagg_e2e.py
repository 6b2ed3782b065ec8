"""Disaggregated serving with real processes: output token-identical to the colocated engine,
one at a time and 12 in flight, over the tcp and nixl backends (and the in-process one), with a
prefix cached on decode, and not-split requests; every scenario ends with both nodes clean."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, NodeConfig
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from pdserve.serve.decode_node import DecodeNode
from pdserve.serve.prefill_node import PrefillNode
from tests.disagg.cluster import (
    assert_clean,
    decode_stub,
    generate,
    nodes,
    prefill_stub,
    start_pair,
)

pytestmark = pytest.mark.slow

ALONE = slice(8, 12)  # the prompts sent one at a time; the rest go in together
SHORT = 12  # output tokens where the scenario, not the length, is under test (greedy: a prefix)


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def pair(smollm_fp32_dir: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    prefill, decode = start_pair(backend=request.param)
    with nodes(prefill, decode):
        yield prefill.address, decode.address


def test_outputs_equal_colocated(pair, prompts, colocated) -> None:  # type: ignore[no-untyped-def]
    """One request at a time (each alone on the link): a quarter of the held-out prompts."""
    d, p = decode_stub(pair[1]), prefill_stub(pair[0])
    for (ids, n), ref in list(zip(prompts, colocated, strict=True))[ALONE]:
        tokens, remote = generate(d, ids, n)
        assert remote
        assert tokens == ref
    assert_clean(d, p)


def test_twelve_in_flight_equal_colocated(pair, prompts, colocated) -> None:  # type: ignore[no-untyped-def]
    """The other held-out prompts at once: batched on both nodes, interleaved on the link."""
    d, p = decode_stub(pair[1]), prefill_stub(pair[0])
    together = [i for i in range(len(prompts)) if i not in range(16)[ALONE]]
    with ThreadPoolExecutor(len(together)) as pool:
        results = list(pool.map(lambda i: generate(d, *prompts[i])[0], together))
    assert results == [colocated[i] for i in together]
    assert_clean(d, p)


def test_shared_prefix_moves_only_missing_blocks(pair, smollm_fp32_dir) -> None:  # type: ignore[no-untyped-def]
    from pdserve.model.tokenizer import Tokenizer

    d, p = decode_stub(pair[1]), prefill_stub(pair[0])
    tok = Tokenizer(smollm_fp32_dir)
    prefix = tok.encode("System: you are a terse assistant who answers in one line. " * 5)
    first = prefix + tok.encode("User: name a fruit.")
    second = prefix + tok.encode("User: name a river.")
    before = d.GetStats(pb.StatsRequest()).bytes_received
    generate(d, first, 8)
    mid = d.GetStats(pb.StatsRequest()).bytes_received
    generate(d, second, 8)
    after = d.GetStats(pb.StatsRequest()).bytes_received
    block_bytes_all_layers = 30 * 2 * 3 * 16 * 64 * 4  # layers * K/V * heads * block * dim * fp32
    blocks = lambda ids: -(-len(ids) // 16)  # noqa: E731
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert mid - before == blocks(first) * block_bytes_all_layers
    assert after - mid == (blocks(second) - common // 16) * block_bytes_all_layers
    assert common // 16 > 0
    assert_clean(d, p)


def test_not_split_requests_run_locally_and_are_counted(pair, prompts, colocated) -> None:  # type: ignore[no-untyped-def]
    d, p = decode_stub(pair[1]), prefill_stub(pair[0])
    before = d.GetStats(pb.StatsRequest()).not_split
    ids, _ = prompts[0]
    tokens, remote = generate(d, ids, 1)  # max_tokens == 1: nothing to disaggregate
    assert not remote and tokens == colocated[0][:1]
    short, remote = generate(d, ids[:4], 5)  # below --min-prefill-tokens
    assert not remote and len(short) == 5
    assert d.GetStats(pb.StatsRequest()).not_split == before + 2
    # A prompt decode has just cached (16-token blocks): what is left of it (3 tokens) is below
    # --min-prefill-tokens, so it is computed here, from the cache, to the same tokens as the
    # disaggregated run. (Reversed: a prompt no other test sent, nothing of it cached before.)
    ids = list(reversed(max((ids for ids, _ in prompts), key=len)))[: 4 * 16 + 3]
    assert len(ids) == 67
    first, remote = generate(d, ids, 16)
    assert remote
    again, remote = generate(d, ids, 16)
    assert not remote and again == first
    assert d.GetStats(pb.StatsRequest()).not_split == before + 3
    assert_clean(d, p)


def test_inprocess_backend_outputs_equal_colocated(smollm_fp32_dir, prompts, colocated) -> None:  # type: ignore[no-untyped-def]
    config = EngineConfig(dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=512))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(120)  # noqa: E731
    prefill = PrefillNode(config, smollm_fp32_dir, NodeConfig(transfer_backend="inprocess"))
    decode = None
    threads = torch.get_num_threads()
    try:
        run(prefill.start())
        assert prefill.grpc is not None
        decode = DecodeNode(
            config,
            smollm_fp32_dir,
            NodeConfig(transfer_backend="inprocess", prefill_addresses=(prefill.grpc.address,)),
        )
        run(decode.start())
        assert decode.grpc is not None
        d, p = decode_stub(decode.grpc.address), prefill_stub(prefill.grpc.address)
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda pn: generate(d, *pn), prompts[:6]))
        assert all(remote for _, remote in results)
        assert [tokens for tokens, _ in results] == colocated[:6]
        assert_clean(d, p)
    finally:
        if decode is not None:
            run(decode.stop())
        run(prefill.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        torch.set_num_threads(threads)


# Prompts of the tiny model's vocabulary, 40-110 tokens (every one split to prefill).
TINY_PROMPTS = [[3 + (7 * i + 11 * j) % 250 for j in range(40 + 10 * i)] for i in range(8)]


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_one_abort_mid_transfer_leaves_the_other_requests_on_the_link_untouched(
    tiny30: Path, backend: str
) -> None:
    """8 requests share one prefill->decode link; the first is cancelled while its layers are
    in flight. Its late frames are refused alone: the other 7 complete token-identical to the
    colocated engine over the same connection (never reopened), and both nodes end clean."""
    engine = LLMEngine(EngineConfig(dtype="float32", num_threads=1), tiny30)
    params = SamplingParams(max_tokens=SHORT, temperature=0.0, ignore_eos=True)
    reference = [out.token_ids for out in engine.generate(TINY_PROMPTS[1:], params)]
    slow = ["--testing-transfer-delay-ms", "20"]
    prefill, decode = start_pair(prefill_args=slow, backend=backend, model=tiny30)
    with nodes(prefill, decode):
        d, p = decode_stub(decode.address), prefill_stub(prefill.address)
        sampling = pb.SamplingConfig(max_tokens=SHORT, temperature=0.0, ignore_eos=True)
        victim = d.Generate(pb.GenerateRequest(token_ids=TINY_PROMPTS[0], sampling=sampling))
        with ThreadPoolExecutor(7) as pool:
            futures = [pool.submit(generate, d, ids, SHORT) for ids in TINY_PROMPTS[1:]]
            deadline = time.monotonic() + 30
            while d.GetStats(pb.StatsRequest()).bytes_received == 0:  # the victim's layers flow
                assert time.monotonic() < deadline
                time.sleep(0.01)
            victim.cancel()
            results = [f.result(timeout=120) for f in futures]
        assert all(remote for _, remote in results)
        assert [tokens for tokens, _ in results] == reference
        if backend == "tcp":  # nixl has no link of its own to count
            assert p.GetStats(pb.StatsRequest()).transfer_links_opened == 1
        assert_clean(d, p)
