"""--deterministic across the split: SmolLM2 (TCP and NIXL) and a tiny random Llama (TCP), in
bf16 and in float32, prefilled on a prefill node and decoded on a decode node, 8 requests at
once, give the very tokens and logprobs (compared with `==`) the colocated engine gives each
prompt alone, with the flag on every side."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from tests.disagg.cluster import assert_clean, decode_stub, nodes, prefill_stub, start_pair
from tests.helpers import THREADS, TINY_VOCAB

pytestmark = pytest.mark.slow

TOKENS = 10
DET = ["--deterministic"]


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(23)
    low = min(1000, vocab // 4)
    return [[rng.randrange(low, vocab) for _ in range(rng.randint(40, 120))] for _ in range(8)]


def remote(stub: pb_grpc.DecodeServiceStub, ids: list[int]) -> tuple[list[int], list[float]]:
    sampling = pb.SamplingConfig(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    tokens: list[int] = []
    logprobs: list[float] = []
    split = False
    for r in stub.Generate(pb.GenerateRequest(token_ids=ids, sampling=sampling)):
        tokens.extend(r.token_ids)
        logprobs.extend(r.logprobs)
        split = split or r.remote_prefill
    assert split, "the prompt was prefilled on decode itself"
    return tokens, logprobs


CASES = [
    ("smollm", dtype, backend) for dtype in ("bfloat16", "float32") for backend in ("tcp", "nixl")
] + [("tiny", dtype, "tcp") for dtype in ("bfloat16", "float32")]


@pytest.mark.parametrize(("model", "dtype", "backend"), CASES)
def test_disaggregated_equals_colocated_alone_bit_for_bit(
    request: pytest.FixtureRequest, model: str, dtype: str, backend: str
) -> None:
    if model == "tiny":
        model_dir, vocab = request.getfixturevalue("tiny30"), TINY_VOCAB
    else:
        fixture = "smollm_bf16_dir" if dtype == "bfloat16" else "smollm_fp32_dir"
        model_dir, vocab = request.getfixturevalue(fixture), 49152
    batch = prompts(vocab)
    config = EngineConfig(
        dtype=dtype, num_threads=THREADS, cache=CacheConfig(num_blocks=256), deterministic=True
    )
    threads = torch.get_num_threads()
    try:
        engine = LLMEngine(config, model_dir)
        params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
        alone = [engine.generate([ids], params)[0] for ids in batch]
    finally:
        torch.set_num_threads(threads)
    # float32 logprobs, as the wire carries them
    expected = [
        (list(o.token_ids), torch.tensor(o.logprobs, dtype=torch.float32).tolist()) for o in alone
    ]
    prefill, decode = start_pair(
        DET, DET, dtype=dtype, backend=backend, model=model_dir if model == "tiny" else None
    )
    with nodes(prefill, decode):
        d = decode_stub(decode.address)
        with ThreadPoolExecutor(len(batch)) as pool:
            got = list(pool.map(lambda ids: remote(d, ids), batch))
        assert got == expected
        assert_clean(d, prefill_stub(prefill.address))
