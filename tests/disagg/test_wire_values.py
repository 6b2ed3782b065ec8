"""Numbers that arrive on the wire are checked where they arrive, before anything is
registered, with real processes (SmolLM2, fp32): a Generate with a timeout that is not a
time (inf, NaN, beyond a day, negative) is refused alone while 6 requests sharing its prefill
link complete token-identical to colocated; a Prefill whose absolute deadline is not a time
is refused naming the field; a request id reused while the first request runs is
ALREADY_EXISTS and the first completes untouched."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.disagg.proto import pdserve_pb2 as pb
from tests.disagg.cluster import (
    assert_clean,
    decode_stub,
    generate,
    nodes,
    prefill_stub,
    start_pair,
)

pytestmark = pytest.mark.slow

SHORT = 8
BAD_TIMEOUTS = (math.inf, math.nan, 1e12, -1.0)


def refusal(call) -> grpc.RpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_bad_wire_values_are_refused_alone(prompts, colocated) -> None:  # type: ignore[no-untyped-def]
    prefill, decode = start_pair()
    with nodes(prefill, decode):
        d, p = decode_stub(decode.address), prefill_stub(prefill.address)
        ids = prompts[0][0]
        with ThreadPoolExecutor(len(BAD_TIMEOUTS) + 6) as pool:
            good = [pool.submit(generate, d, ids, SHORT) for ids, _ in prompts[:6]]
            bad = [
                pool.submit(refusal, lambda t=t: generate(d, ids, SHORT, timeout_s=t))
                for t in BAD_TIMEOUTS
            ]
            for f in bad:
                e = f.result()
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
                assert "timeout_s" in e.details()
            for f, ref in zip(good, colocated[:6], strict=True):
                tokens, remote = f.result()
                assert remote and tokens == ref[:SHORT]
        for deadline in (math.inf, math.nan, time.time() + 1e12):
            e = refusal(
                lambda deadline=deadline: p.Prefill(
                    pb.PrefillRequest(
                        request_id="r", unique_key="k", token_ids=ids, deadline_unix=deadline
                    ),
                    timeout=10,
                )
            )
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "deadline_unix" in e.details()
        # The same request id twice at once: the second is refused, the first is served.
        long = pb.GenerateRequest(
            request_id="twice",
            token_ids=ids,
            sampling=pb.SamplingConfig(max_tokens=32, temperature=0.0, ignore_eos=True),
        )
        first = d.Generate(long)
        tokens = list(next(first).token_ids)  # it runs
        e = refusal(lambda: list(d.Generate(long)))
        assert e.code() == grpc.StatusCode.ALREADY_EXISTS, e
        tokens += [t for r in first for t in r.token_ids]
        assert tokens == colocated[0][:32]  # untouched
        assert_clean(d, p)
