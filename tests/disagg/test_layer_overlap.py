"""Layer-wise overlap with a controllable prefill: layer 0 reaches decode while the last
layer's KV is not even computed (its event unfired)."""

from __future__ import annotations

import time

import torch

from pdserve.disagg.kv_sender import KVSender
from pdserve.disagg.send_target import PrefillOutcome, SendTarget
from pdserve.disagg.transport.regions import KVRegions
from pdserve.disagg.transport.tcp_sender import TcpSender
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import SamplingParams, Sequence, SequenceStatus
from pdserve.engine.snapshot import NodeSnapshot
from tests.disagg.kvfixtures import (
    NUM_LAYERS,
    ManualEvent,
    Receiver,
    caches,
    layers_received,
    wait_for_layer,
)


def test_layer_zero_arrives_before_last_layer_event_fires() -> None:
    receiver = Receiver()
    src = caches(seed=9)
    events = [ManualEvent() for _ in range(NUM_LAYERS)]
    made = iter(events)
    transport = TcpSender(KVRegions(src))
    sender = KVSender(transport, NUM_LAYERS, block_size=4, event_factory=lambda: next(made))
    outcomes: list[PrefillOutcome] = []
    try:
        receiver.register("u", [6, 7])
        seq = Sequence("u", list(range(8)), SamplingParams(max_tokens=1))
        seq.block_table = [2, 5]
        sender.add_target(
            SendTarget("r", "u", receiver.address, [6, 7], 0, time.time() + 10), outcomes.append
        )
        hook = sender.layer_hook(SchedulerOutput([ScheduledSeq(seq, 8, sample=True)]))
        assert hook is not None
        for layer in range(NUM_LAYERS):
            hook(layer)  # the model finished writing this layer; its event may still be pending
        events[0].fire()
        assert wait_for_layer(receiver.store, "u", 0, time.time() + 5)
        assert not events[-1].ready()
        assert layers_received(receiver.store, "u") == {0}
        assert torch.equal(receiver.caches[0][6], src[0][2])
        for e in events[1:]:
            e.fire()
        assert wait_for_layer(receiver.store, "u", NUM_LAYERS - 1, time.time() + 5)
        seq.output_token_ids = [11]
        seq.status = SequenceStatus.FINISHED_LENGTH
        sender.request_finished(seq)
        deadline = time.time() + 5
        while not outcomes and time.time() < deadline:
            sender.poll_finished_sends()
            time.sleep(0.01)
        assert outcomes and outcomes[0].error is None and outcomes[0].first_token == 11
        snapshot = NodeSnapshot()
        sender.add_stats(snapshot)
        assert snapshot.pending_transfers == 0
    finally:
        transport.close()
        receiver.close()
