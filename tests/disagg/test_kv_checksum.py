"""--kv-checksum end to end: prefill checksums each layer from its own blocks, decode verifies
the bytes written into its blocks before a frame counts. A byte corrupted in flight fails that
request alone (KV_CORRUPT, naming the peer and the layer, counted), the link keeps serving the
other requests on it, and their outputs stay token-identical to the colocated engine; a frame
without checksums is a protocol violation where decode expects them. Over TCP (the sender's own
frames and a live receiver, then real nodes) and NIXL (real nodes: decode verifies what it
READ)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
import xxhash

from pdserve.config import EngineConfig
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.resource_store import KVLoadError
from pdserve.disagg.transport.base import LayerWrite, encode_header
from pdserve.disagg.transport.regions import KVRegions
from pdserve.disagg.transport.tcp_sender import TcpSender
from pdserve.disagg.wire import SideChannelData
from pdserve.engine.failure import FailureReason
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from tests.disagg.cluster import (
    assert_clean,
    decode_stub,
    generate,
    nodes,
    prefill_stub,
    start_pair,
)
from tests.disagg.kvfixtures import NUM_LAYERS, Receiver, caches, connect
from tests.disagg.test_disagg_e2e import SHORT, TINY_PROMPTS
from tests.disagg.test_transport import Completions, write_all_layers


def corrupt_one_byte_of_the_first_frame(receiver: Receiver) -> None:
    """What the nodes' --testing-corrupt-kv-frame 1 does: one byte of the first frame flipped
    in decode's blocks once it arrived."""
    receiver.receiver._testing_corrupt_frame = 1


def claim(receiver: Receiver, key: str) -> object:
    receiver.store.put_side_channel(
        key, SideChannelData(has_first_token=True, first_token=0), time.time() + 5
    )
    return receiver.store.load_cache_sync(key, time.time() + 5)


def test_frames_carry_each_layers_xxh3_of_the_senders_blocks() -> None:
    src = caches(seed=5)
    sender = TcpSender(KVRegions(src))
    sender.checksum = True
    writes = [
        LayerWrite("x:1", "k", layer, [4, 2, 3], [0, 1, 2], time.time() + 5, lambda e: None)
        for layer in (1, 2)
    ]
    header, _ = sender.data_frame(writes)
    # Independently: the layer's blocks in frame order, K and V of every head, as bytes.
    expected = [
        xxhash.xxh3_64_intdigest(src[layer][[4, 2, 3]].contiguous().view(torch.uint8).numpy())
        for layer in (1, 2)
    ]
    assert list(header.layer_checksums) == expected
    sender.checksum = False
    assert list(sender.data_frame(writes)[0].layer_checksums) == []
    sender.close()


def test_a_corrupted_frame_fails_its_request_alone_and_the_link_serves_the_next() -> None:
    receiver = Receiver(verify=True)
    corrupt_one_byte_of_the_first_frame(receiver)
    src = caches(seed=3)
    sender = TcpSender(KVRegions(src))
    sender.checksum = True
    try:
        receiver.register("bad", [5, 6, 1])
        done = Completions(sender)
        write_all_layers(sender, receiver.address, "bad", [0, 1, 7], [5, 6, 1], done)
        results = done.wait(NUM_LAYERS)
        refused = [e for e in results if e is not None]
        assert refused and "checksum_mismatch" in str(refused[0])  # the sender hears why
        with pytest.raises(KVLoadError) as e:
            claim(receiver, "bad")
        failure = e.value.failure
        assert failure.reason == FailureReason.KV_CORRUPT
        assert "layer 0" in failure.message and "checksum" in failure.message
        assert receiver.receiver.checksum_failures == {"": 1}

        receiver.register("good", [2, 3, 4])
        done = Completions(sender)
        write_all_layers(sender, receiver.address, "good", [0, 1, 7], [2, 3, 4], done)
        assert done.wait(NUM_LAYERS) == [None] * NUM_LAYERS
        claim(receiver, "good")
        for layer in range(NUM_LAYERS):
            for s, d in ((0, 2), (1, 3), (7, 4)):
                assert torch.equal(receiver.caches[layer][d], src[layer][s])
        assert sender.links_opened == 1  # the same connection throughout
        assert receiver.receiver.checksum_failures == {"": 1}
    finally:
        sender.close()
        receiver.close()


def test_a_frame_without_checksums_is_a_violation_where_decode_expects_them() -> None:
    receiver = Receiver(verify=True)
    try:
        receiver.register("k", [1])
        header = pb.TransferFrameHeader(
            kind=pb.TransferFrameHeader.DATA,
            unique_key="k",
            layer=0,
            block_ids=[1],
            head_count=receiver.regions.num_kv_heads,
            block_bytes=receiver.regions.block_bytes,
        )
        sock = connect(receiver.address)
        sock.sendall(encode_header(header) + bytes(receiver.regions.block_bytes))
        try:  # the connection is closed (EOF, or a reset: the payload was left unread)
            ack = sock.recv(1)
        except ConnectionResetError:
            ack = b""
        assert ack == b"", "nothing may be acknowledged"
        sock.close()
        assert receiver.store.frames_rejected.get("checksum_missing") == 1
        with pytest.raises(KVLoadError):
            claim(receiver, "k")
    finally:
        receiver.close()


# ---- real nodes -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "on_failure"), [("tcp", "fail"), ("nixl", "fail"), ("tcp", "local")]
)
def test_a_byte_corrupted_in_flight_costs_that_request_alone(
    tiny30: Path, backend: str, on_failure: str
) -> None:
    """8 requests at once through a pair with --kv-checksum; decode flips one byte of the
    first frame that reaches it. With `--prefill-failure fail` exactly that request fails,
    DATA_LOSS naming the layer and the prefill node; by default (`local`) decode computes its
    prompt itself instead and it completes too. The others equal the colocated engine's output
    (all 8 do, in `local`); one failure is counted and both nodes end clean."""
    engine = LLMEngine(EngineConfig(dtype="float32", num_threads=1), tiny30)
    params = SamplingParams(max_tokens=SHORT, temperature=0.0, ignore_eos=True)
    reference = [out.token_ids for out in engine.generate(TINY_PROMPTS, params)]
    prefill, decode = start_pair(
        decode_args=["--testing-corrupt-kv-frame", "1", "--prefill-failure", on_failure],
        backend=backend,
        model=tiny30,
    )
    with nodes(prefill, decode):
        d, p = decode_stub(decode.address), prefill_stub(prefill.address)

        def one(ids: list[int]) -> tuple[list[int], bool] | grpc.RpcError:
            try:
                return generate(d, ids, SHORT)
            except grpc.RpcError as e:
                return e

        with ThreadPoolExecutor(len(TINY_PROMPTS)) as pool:
            results = list(pool.map(one, TINY_PROMPTS))
        failed = [r for r in results if isinstance(r, grpc.RpcError)]
        served = [r for r in results if not isinstance(r, grpc.RpcError)]
        if on_failure == "fail":
            assert len(failed) == 1 and all(remote for _, remote in served), results
            assert failed[0].code() == grpc.StatusCode.DATA_LOSS
            details = failed[0].details() or ""
            assert "checksum" in details and "layer 0" in details and prefill.address in details
        else:
            assert not failed and [remote for _, remote in served].count(False) == 1, results
        for got, want in zip(results, reference, strict=True):
            if not isinstance(got, grpc.RpcError):
                assert got[0] == want
        assert d.GetStats(pb.StatsRequest()).kv_checksum_failures == 1
        assert_clean(d, p)
