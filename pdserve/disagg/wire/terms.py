"""What two peers must share for one's KV to continue the other's computation (the model
fingerprint a decode's probe compares with its prefill's), built and compared here only. Every
field is one a mismatch in would not fail loudly but corrupt output silently: the model's shape,
the weights' dtype and quantization, the KV cache's element type, block size, bytes per block
and layout, RoPE's parameters, the tokenizer, the transfer backend, and the modes that change
what the bytes must be (`--deterministic`, and under it the kernels whose sums the bits follow) or
what a frame carries (`--kv-checksum`)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import ModelConfig
from pdserve.disagg.proto import pdserve_pb2 as pb

__all__ = ["FINGERPRINT_FIELDS", "NodeTerms", "fingerprint", "fingerprint_mismatch"]

FINGERPRINT_FIELDS = (
    "architecture",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "block_size",
    "quantization",
    "transfer_backend",
    "kv_dtype",
    "block_bytes",
    "kv_layout",
    "rope",
    "tokenizer",
    "deterministic",
    "kv_checksum",
    "kernels",
)


@dataclass(frozen=True)
class NodeTerms:
    """A node's side of the fingerprint beyond the model's config: `dtype` the weights',
    `kv_dtype` the cache's, `block_bytes` one block of one layer (every head), `kv_layout` the
    cache tensor's dimensions, `tokenizer` a digest of its files, `kernels` under --deterministic
    the CPU kernels whose sums its bits follow (AMX tiles, AVX512 or AVX2 panels: a bf16 row's
    sums run in another order on each)."""

    dtype: str
    block_size: int
    quantization: str
    transfer_backend: str
    kv_dtype: str = ""
    block_bytes: int = 0
    kv_layout: str = ""
    tokenizer: str = ""
    deterministic: bool = False
    kv_checksum: bool = False
    kernels: str = ""  # under --deterministic: deterministic_kernels()


def _rope(model: ModelConfig) -> str:
    local = "" if model.local_rope_theta is None else f" local_theta={model.local_rope_theta:g}"
    return f"theta={model.rope_theta:g} scaling={model.rope_scaling}{local}"


def fingerprint(model: ModelConfig, terms: NodeTerms) -> pb.ModelFingerprint:
    return pb.ModelFingerprint(
        architecture=model.architecture,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=terms.dtype,
        block_size=terms.block_size,
        quantization=terms.quantization,
        transfer_backend=terms.transfer_backend,
        kv_dtype=terms.kv_dtype,
        block_bytes=terms.block_bytes,
        kv_layout=terms.kv_layout,
        rope=_rope(model),
        tokenizer=terms.tokenizer,
        deterministic=terms.deterministic,
        kv_checksum=terms.kv_checksum,
        kernels=terms.kernels,
    )


def fingerprint_mismatch(local: pb.ModelFingerprint, remote: pb.ModelFingerprint) -> str | None:
    """Every field in which decode (`local`) and prefill (`remote`) differ, naming both values;
    None if they agree."""
    diffs = [
        f"{name}: decode={getattr(local, name)!r} prefill={getattr(remote, name)!r}"
        for name in FINGERPRINT_FIELDS
        if getattr(local, name) != getattr(remote, name)
    ]
    return "; ".join(diffs) if diffs else None
