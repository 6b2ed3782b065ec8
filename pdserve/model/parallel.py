"""Tensor-parallel sharding of the Llama-family decoder (Megatron style, as vLLM shards it).

Rank r of N keeps attention heads [r*H/N, (r+1)*H/N) and the KV heads they read: KV heads are
split when N divides them and replicated when they divide N (each rank then holds the one KV
head of its query heads). q/k/v and gate/up are split by rows (column-parallel), o_proj and
down_proj by columns (row-parallel: one all-reduce after attention and one after the MLP); the
output projection is split by vocabulary rows and its logits gathered. Embeddings and norms are
replicated. Every tensor is sliced from the checkpoint as it is read: no rank holds the whole
model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.config import ConfigError, ModelConfig


class Collectives(Protocol):
    """What a sharded model needs from its process group."""

    def all_reduce(self, tensor: torch.Tensor) -> None: ...

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} outside a group of {self.world}")


WHOLE = Shard(0, 1)  # no tensor parallelism


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """Refuse, naming the head counts, a tensor-parallel size the model's heads do not allow."""
    if world < 1:
        raise ConfigError(f"tensor-parallel size must be >= 1, got {world}")
    if world == 1:
        return
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    if heads % world or (kv % world and world % kv):
        raise ConfigError(
            f"tensor-parallel size {world} does not fit this model's heads: "
            f"{heads} attention heads and {kv} KV heads (the size must divide the attention "
            f"heads, and divide or be a multiple of the KV heads)"
        )
    if cfg.intermediate_size % world:
        raise ConfigError(
            f"tensor-parallel size {world} does not divide the MLP width {cfg.intermediate_size}"
        )


def local_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The shapes one rank computes: its heads, its KV heads, its slice of the MLP."""
    check_shardable(cfg, shard.world)
    n = shard.world
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // n,
        num_kv_heads=max(cfg.num_kv_heads // n, 1),
        intermediate_size=cfg.intermediate_size // n,
    )


def kv_head_range(cfg: ModelConfig, shard: Shard) -> tuple[int, int]:
    """(first KV head, count) this rank holds in its cache."""
    n, kv = shard.world, cfg.num_kv_heads
    if kv >= n:
        return shard.rank * (kv // n), kv // n
    return shard.rank // (n // kv), 1


def vocab_parallel(cfg: ModelConfig, shard: Shard) -> bool:
    """Whether the output projection is split by vocabulary (else each rank keeps it whole)."""
    return shard.world > 1 and cfg.vocab_size % shard.world == 0


def _rows(tensor: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return tensor[start : start + count]


def shard_tensor(name: str, tensor: torch.Tensor, cfg: ModelConfig, shard: Shard) -> torch.Tensor:
    """This rank's part of one checkpoint tensor (named as in Hugging Face checkpoints)."""
    if shard.world == 1:
        return tensor
    r, n, d = shard.rank, shard.world, cfg.head_dim
    parts = name.removeprefix("model.").split(".")
    proj = parts[-2] if len(parts) >= 2 else ""
    heads = cfg.num_heads // n
    if proj == "q_proj":
        return _rows(tensor, r * heads * d, heads * d)
    if proj in ("k_proj", "v_proj"):
        first, count = kv_head_range(cfg, shard)
        return _rows(tensor, first * d, count * d)
    if proj in ("gate_proj", "up_proj"):
        width = cfg.intermediate_size // n
        return _rows(tensor, r * width, width)
    if proj == "o_proj" and parts[-1] == "weight":
        return tensor[:, r * heads * d : (r + 1) * heads * d]
    if proj == "o_proj":  # its bias is added once, after the all-reduce
        return tensor if r == 0 else torch.zeros_like(tensor)
    if proj == "down_proj":
        width = cfg.intermediate_size // n
        return tensor[:, r * width : (r + 1) * width]
    if name.removeprefix("model.") == "lm_head.weight" and vocab_parallel(cfg, shard):
        rows = cfg.vocab_size // n
        return _rows(tensor, r * rows, rows)
    return tensor  # embeddings, norms: replicated
