"""How a failure reads: its stage and peer named once, also when the message came back from a
peer that had already named them."""

from __future__ import annotations

from pdserve.engine.failure import Failure, FailureReason


def test_stage_and_peer_are_named_once() -> None:
    local = Failure(FailureReason.DEADLINE, "deadline passed", "prefill/transfer", "10.0.0.2:7")
    assert str(local) == "deadline passed (stage: prefill/transfer, peer: 10.0.0.2:7)"
    # decode reads prefill's gRPC details back into a Failure with the same stage
    echoed = Failure(FailureReason.DEADLINE, f"prefill 10.0.0.2:7 failed: {local}",
                     "prefill/transfer", "10.0.0.2:7")  # fmt: skip
    assert str(echoed).count("stage: prefill/transfer") == 1
    assert str(echoed).count("10.0.0.2:7") == 2  # the peer's own message plus "prefill <peer>"
