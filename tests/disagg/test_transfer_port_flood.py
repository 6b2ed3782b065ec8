"""1,000 idle connections to a decode node's transfer port from one address (real processes on
loopback): the node keeps serving disaggregated requests token-identical to colocated over the
link prefill already holds, its thread count stays bounded by the per-address handshake cap,
the connections beyond it are refused and the idle ones are closed after the handshake
timeout, all counted."""

from __future__ import annotations

import contextlib
import resource
import socket
import time

import pytest

from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.transport.handshake import HANDSHAKE_TIMEOUT_S
from pdserve.disagg.transport.tcp_receiver import MAX_HANDSHAKES_PER_ADDRESS
from tests.disagg.cluster import (
    assert_clean,
    decode_stub,
    free_port,
    generate,
    nodes,
    prefill_stub,
    start_pair,
)

pytestmark = pytest.mark.slow

FLOOD = 1000
CAP = 64
SHORT = 8  # output tokens per request (greedy: the colocated output's prefix)


def test_a_thousand_idle_connections_do_not_stop_decode(prompts, colocated) -> None:  # type: ignore[no-untyped-def]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FLOOD + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, FLOOD + 512), hard))
    transfer_port = free_port()
    prefill, decode = start_pair(
        decode_args=["--transfer-port", str(transfer_port), "--max-transfer-connections", str(CAP)]
    )
    with nodes(prefill, decode), contextlib.ExitStack() as flood:
        d, p = decode_stub(decode.address), prefill_stub(prefill.address)
        ids, _ = prompts[0]
        tokens, remote = generate(d, ids, SHORT)  # prefill's link to decode is up
        assert remote and tokens == colocated[0][:SHORT]
        baseline = d.GetStats(pb.StatsRequest()).threads
        for _ in range(FLOOD):
            flood.enter_context(socket.create_connection(("127.0.0.1", transfer_port), timeout=5))
        for (ids, _), ref in list(zip(prompts, colocated, strict=True))[1:4]:
            tokens, remote = generate(d, ids, SHORT)  # served during the flood
            assert remote and tokens == ref[:SHORT]
        assert d.GetStats(pb.StatsRequest()).threads <= baseline + MAX_HANDSHAKES_PER_ADDRESS + 2
        # Every flooding connection is accounted for: refused at once (one address may hold
        # only so many handshakes), or let in and closed when its handshake did not come.
        deadline = time.monotonic() + 6 * HANDSHAKE_TIMEOUT_S
        while True:
            closed = d.GetStats(pb.StatsRequest()).transfer_connections
            refused = closed["refused_over_cap"] + closed["refused_per_address"]
            if refused + closed["handshake_failed"] >= FLOOD:
                break
            assert time.monotonic() < deadline, f"idle connections were not closed: {closed}"
            time.sleep(0.2)
        assert closed["handshake_failed"] >= MAX_HANDSHAKES_PER_ADDRESS  # the first ones let in
        assert closed["refused_per_address"] > 0
        flood.close()
        deadline = time.monotonic() + 10
        while d.GetStats(pb.StatsRequest()).threads > baseline:
            assert time.monotonic() < deadline, "connection threads did not end"
            time.sleep(0.2)
        ids, _ = prompts[4]
        tokens, remote = generate(d, ids, SHORT)
        assert remote and tokens == colocated[4][:SHORT]
        assert_clean(d, p)
