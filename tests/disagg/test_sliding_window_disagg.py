"""A model with sliding-window layers through a disaggregated pair (a tiny random Gemma 3: a
windowed layer of 24 positions between two full-attention ones), over TCP and NIXL: decode
receives the windowed layer's blocks of the last window only, counted to the byte, and its
output is token-identical to the colocated engine's — also when a later prompt shares a
prefix whose early blocks decode holds without the windowed layer's KV: reused where its KV
comes by handoff (the prefill node computes over its own cache), computed again where decode
computes it itself."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.engine.sequence import SamplingParams
from tests.disagg.cluster import (
    assert_clean,
    decode_stub,
    nodes,
    prefill_stub,
    start_pair,
)
from tests.helpers import make_engine, make_tiny_model

pytestmark = pytest.mark.slow

WINDOW = 24
BLOCK = 16
NEW = 16
MIN_PREFILL = 40
# the tiny model's layers: full, windowed, full; K and V of 2 KV heads of 32 dims, fp32
BLOCK_BYTES = 2 * 2 * BLOCK * 32 * 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gemma3w"), "gemma3", sliding_window=WINDOW)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sent_blocks(num_tokens: int, skipped: int = 0) -> int:
    """Blocks of all three layers decode must receive for `num_tokens` tokens of KV when it
    holds the first `skipped` blocks: every block for the full layers; for the windowed one,
    those the window of a query at the start of the last block reads (where the same tokens
    would be computed on decode)."""
    blocks = -(-num_tokens // BLOCK)
    last_start = (num_tokens - 1) // BLOCK * BLOCK
    window_first = max(skipped, max(0, last_start - WINDOW + 1) // BLOCK)
    return 2 * (blocks - skipped) + (blocks - window_first)


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def pair(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    # remainders under 40 tokens are computed on decode itself
    decode_args = ["--min-prefill-tokens", str(MIN_PREFILL)]
    prefill, decode = start_pair(backend=request.param, model=model_dir, decode_args=decode_args)
    with nodes(prefill, decode):
        yield prefill.address, decode.address


def test_windowed_layers_get_their_window_and_output_equals_colocated(
    pair: tuple[str, str], model_dir: Path
) -> None:
    first = tokens(1, 100)
    # shares 3 blocks with `first`, which decode holds without the windowed layer's KV (it was
    # behind first's window); decode's window after this prompt starts at block 4: reused
    shares_early = first[:60] + tokens(2, 40)
    # `first` whole and more: the windowed layer's blocks of first's last window are there
    extends = first + tokens(3, 45)
    # 20 tokens past first's 3 partial blocks: too few to send (< MIN_PREFILL), so computed
    # on decode, whose window reads those blocks: they are computed again
    short_rest = first[:48] + tokens(4, 20)
    # sent twice: the second time decode computes the last 14 tokens itself over the first's
    # 6 blocks, its window reading from block 4 (what the handoff's windowed blocks start at,
    # though decode's own next query after 110 tokens reads from block 5)
    again = tokens(5, 110)
    prompts = [first, shares_early, extends, short_rest, again, again]
    engine = make_engine(model_dir)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    colocated = [o.token_ids for o in engine.generate(prompts, [params] * len(prompts))]
    d, p = decode_stub(pair[1]), prefill_stub(pair[0])
    received, remotes, cached = [], [], []
    for ids, ref in zip(prompts, colocated, strict=True):
        before = d.GetStats(pb.StatsRequest()).bytes_received
        request = pb.GenerateRequest(
            token_ids=ids,
            sampling=pb.SamplingConfig(max_tokens=NEW, temperature=0.0, ignore_eos=True),
        )
        answers = list(d.Generate(request))
        received.append(d.GetStats(pb.StatsRequest()).bytes_received - before)
        remotes.append(any(a.remote_prefill for a in answers))
        cached.append(max(a.num_cached_tokens for a in answers))
        assert [t for a in answers for t in a.token_ids] == ref
    assert remotes == [True, True, True, False, True, False]
    assert received[0] == sent_blocks(100) * BLOCK_BYTES  # 2 * 7 + 3 blocks, not 3 * 7
    assert received[1] == sent_blocks(100, skipped=3) * BLOCK_BYTES
    assert received[2] == sent_blocks(145, skipped=6) * BLOCK_BYTES  # first's 6 full blocks
    assert received[3] == 0 and cached[3] == 0  # nothing reusable where decode computes
    assert received[4] == sent_blocks(110) * BLOCK_BYTES
    assert received[5] == 0 and cached[5] == 96
    assert_clean(d, p)
