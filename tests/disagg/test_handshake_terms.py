"""The probe refuses a prefill whose KV would not mean the same to decode, naming both values.

Two halves. First, real configurations: two nodes whose settings differ in one respect (dtype,
block size, quantization, RoPE, tokenizer files, --kv-checksum, transfer backend, the
kernels --deterministic's bits follow) show
fingerprints that differ exactly where that respect shows. Second, the refusal itself, one
test per kind of mismatch the issue lists: decode's prefill client probes a real gRPC prefill
peer on loopback whose fingerprint is decode's own but for that one value, and the call fails
with MODEL_MISMATCH naming the field and both values, before any KV is asked for. Some kinds
cannot differ between two builds of today's pdserve (the KV layout, a KV dtype other than the
weights'), so a peer of another build is what shows them."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import grpc
import pytest

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, NodeConfig
from pdserve.disagg.prefill_client import PrefillCallError, PrefillClient, ProbePolicy
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.engine.failure import FailureReason
from pdserve.model.fused import compiled
from pdserve.model.isa import Isa, chosen_isa
from pdserve.serve.engine_node import node_fingerprint
from tests.helpers import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("terms") / "tiny")


def fingerprint_of(
    model_dir: Path,
    dtype: str = "float32",
    block_size: int = 16,
    quantization: str = "none",
    node: NodeConfig | None = None,
    deterministic: bool = False,
) -> pb.ModelFingerprint:
    config = EngineConfig(
        dtype=dtype,
        quantization=quantization,
        cache=CacheConfig(block_size=block_size),
        deterministic=deterministic,
    )
    model = ModelConfig.from_dir(model_dir)
    return node_fingerprint(config, model, model_dir, node or NodeConfig())


def differing(a: pb.ModelFingerprint, b: pb.ModelFingerprint) -> set[str]:
    return {f.name for f in a.DESCRIPTOR.fields if getattr(a, f.name) != getattr(b, f.name)}


def edited_copy(model_dir: Path, out: Path, name: str, edit: dict[str, object]) -> Path:
    """A copy of `model_dir` whose JSON file `name` has `edit` merged in."""
    shutil.copytree(model_dir, out)
    path = out / name
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    return out


def test_nodes_configured_alike_show_the_same_fingerprint(tiny: Path) -> None:
    assert differing(fingerprint_of(tiny), fingerprint_of(tiny)) == set()


def test_a_dtype_difference_shows_in_weights_kv_and_bytes_per_block(tiny: Path) -> None:
    a, b = fingerprint_of(tiny, "float32"), fingerprint_of(tiny, "bfloat16")
    assert differing(a, b) == {"dtype", "kv_dtype", "block_bytes"}
    assert (a.kv_dtype, b.kv_dtype) == ("float32", "bfloat16")
    assert a.block_bytes == 2 * b.block_bytes


def test_a_block_size_difference_shows_in_size_and_bytes_per_block(tiny: Path) -> None:
    a, b = fingerprint_of(tiny, block_size=16), fingerprint_of(tiny, block_size=32)
    assert differing(a, b) == {"block_size", "block_bytes"}
    config = json.loads((tiny / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    # K and V of every KV head for 16 positions, 4 bytes each
    assert a.block_bytes == 2 * config["num_key_value_heads"] * 16 * head_dim * 4


def test_quantized_weights_show(tiny: Path) -> None:
    a = fingerprint_of(tiny, "bfloat16")
    b = fingerprint_of(tiny, "bfloat16", quantization="int8")
    assert differing(a, b) == {"quantization"}


@pytest.mark.parametrize(
    "edit",
    [
        {"rope_theta": 500000.0},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512,
            }
        },
    ],
    ids=["base", "scaling"],
)
def test_rope_parameters_show(tiny: Path, tmp_path: Path, edit: dict[str, object]) -> None:
    other = edited_copy(tiny, tmp_path / "other", "config.json", edit)
    assert differing(fingerprint_of(tiny), fingerprint_of(other)) == {"rope"}


def test_another_tokenizer_shows(tiny: Path, tmp_path: Path) -> None:
    other = edited_copy(tiny, tmp_path / "other", "tokenizer_config.json", {"eos_token": "<x>"})
    assert differing(fingerprint_of(tiny), fingerprint_of(other)) == {"tokenizer"}


def test_kv_checksum_and_backend_show(tiny: Path) -> None:
    plain = fingerprint_of(tiny)
    checked = fingerprint_of(tiny, node=NodeConfig(kv_checksum=True))
    nixl = fingerprint_of(tiny, node=NodeConfig(transfer_backend="nixl"))
    assert differing(plain, checked) == {"kv_checksum"}
    assert differing(plain, nixl) == {"transfer_backend"}


def test_deterministic_shows_the_kernels_its_bits_follow(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under --deterministic a bf16 row's sums run in another order on the AMX tiles, the AVX512
    panels and the AVX2 ones: a node shows which it runs, so that a pair of two kinds of CPU
    (or a node forced to a lower level) is refused rather than silently not bit-identical."""
    plain = fingerprint_of(tiny)
    det = fingerprint_of(tiny, deterministic=True)
    assert differing(plain, det) == {"deterministic", "kernels"}
    assert det.kernels == chosen_isa().kernel_level.name.lower()  # float32: the build's level
    bf16 = fingerprint_of(tiny, dtype="bfloat16", deterministic=True)
    tiles = chosen_isa() == Isa.AMX and compiled() is not None and compiled().amx_ready()
    assert bf16.kernels == ("amx" if tiles else det.kernels)
    if chosen_isa() == Isa.GENERIC:
        pytest.skip("this node runs the generic build (this CPU's only, or forced): no lower level")
    with monkeypatch.context() as env:  # a node started with PDSERVE_ISA=generic
        env.setenv("PDSERVE_ISA", "generic")
        chosen_isa.cache_clear()
        try:
            lower = fingerprint_of(tiny, deterministic=True)
        finally:
            chosen_isa.cache_clear()
    assert differing(det, lower) == {"kernels"} and lower.kernels == "generic"


# ---- the refusal -------------------------------------------------------------------------


class PeerWith(pb_grpc.PrefillServiceServicer):
    """A prefill peer showing `fingerprint`; a Prefill call reaching it is recorded."""

    def __init__(self, fingerprint: pb.ModelFingerprint) -> None:
        self.fingerprint = fingerprint
        self.prefill_calls = 0

    async def GetPeerInfo(self, request: pb.PeerInfoRequest, context: object) -> pb.PeerInfo:
        return pb.PeerInfo(tp_size=1, fingerprint=self.fingerprint, role="prefill")

    async def Prefill(self, request: pb.PrefillRequest, context: object) -> pb.PrefillResponse:
        self.prefill_calls += 1
        return pb.PrefillResponse(has_first_token=True)


async def call_peer(decode: pb.ModelFingerprint, prefill: pb.ModelFingerprint) -> PeerWith:
    """Decode's client calls a peer showing `prefill`; raises what the call raised."""
    peer = PeerWith(prefill)
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    pb_grpc.add_PrefillServiceServicer_to_server(peer, server)
    await server.start()
    client = PrefillClient([f"127.0.0.1:{port}"], decode, probes=ProbePolicy(cap_s=2.0))
    request = pb.PrefillRequest(
        request_id="r", unique_key="r-k", token_ids=[1, 2], deadline_unix=time.time() + 10
    )
    try:
        await client.prefill(request)
        return peer
    finally:
        await client.close()
        await server.stop(0)


# The kinds of mismatch the issue names, each as a value a peer of another build or
# configuration could show.
OTHER_VALUES: dict[str, object] = {
    "architecture": "qwen2",
    "num_layers": 7,
    "head_dim": 128,
    "dtype": "bfloat16",
    "block_size": 32,
    "kv_dtype": "float8_e4m3fn",
    "block_bytes": 1234,
    "kv_layout": "blocks,kv_heads,block_size,kv,head_dim",
    "rope": "theta=500000 scaling=None",
    "quantization": "int4",
    "tokenizer": "0" * 32,
    "deterministic": True,
    "kv_checksum": True,
    "transfer_backend": "nixl",
    "kernels": "avx2",
}


def test_a_peer_like_decode_is_called(tiny: Path) -> None:
    mine = fingerprint_of(tiny)
    peer = asyncio.run(call_peer(mine, mine))
    assert peer.prefill_calls == 1


@pytest.mark.parametrize("field", list(OTHER_VALUES))
def test_a_peer_differing_in_one_term_is_refused_naming_both_values(tiny: Path, field: str) -> None:
    mine = fingerprint_of(tiny)
    theirs = pb.ModelFingerprint()
    theirs.CopyFrom(mine)
    setattr(theirs, field, OTHER_VALUES[field])
    with pytest.raises(PrefillCallError) as e:
        asyncio.run(call_peer(mine, theirs))
    failure = e.value.failure
    assert failure.reason == FailureReason.MODEL_MISMATCH
    assert failure.stage == "peer info probe"
    expected = f"{field}: decode={getattr(mine, field)!r} prefill={OTHER_VALUES[field]!r}"
    assert expected in failure.message
