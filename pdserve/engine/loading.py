"""An engine's model and KV cache, loaded: on this rank alone, or with tensor-parallel workers
that load their own shards meanwhile (every rank's KV in shared memory, rank 0's first). A
failure on the way stops the workers started for it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.kv_cache import (
    KVShard,
    allocate_kv_cache,
    allocate_shared_kv_cache,
    cache_size,
)
from pdserve.engine.tensor_parallel import TensorParallelGroup
from pdserve.model.heap import keep_step_memory
from pdserve.model.llama import LlamaModel
from pdserve.model.loader import TORCH_DTYPES, load_model
from pdserve.model.parallel import Shard, kv_head_range, local_config


@dataclass(frozen=True)
class LoadedModel:
    model_config: ModelConfig
    model: LlamaModel  # this rank's shard
    num_blocks: int  # KV blocks per rank
    window_blocks: int | None  # their windowed layers' parts that fit (engine/kv_cache.py)
    kv_shards: list[KVShard]  # every rank's KV, rank 0's first
    tp: TensorParallelGroup | None  # the workers of ranks 1.., running and watched


def load_engine_model(config: EngineConfig, model_dir: str | Path) -> LoadedModel:
    model_config = ModelConfig.from_dir(model_dir)
    dtype = TORCH_DTYPES[config.dtype]
    block_size = config.cache.block_size
    shard = Shard(0, config.tensor_parallel_size)
    local = local_config(model_config, shard)  # this rank's heads: its cache's shape
    size = cache_size(local, config.cache, dtype)
    num_blocks, lazy = size.num_blocks, size.overcommitted
    tp: TensorParallelGroup | None = None
    kv_shards: list[KVShard] = []
    collectives = None
    if shard.world > 1:  # the workers load their shards while this rank loads its own
        whole: list[torch.Tensor] = []  # per rank, all layers
        for rank in range(shard.world):
            cfg = local_config(model_config, Shard(rank, shard.world))
            cache = allocate_shared_kv_cache(cfg, num_blocks, block_size, dtype, lazy)
            start, _ = kv_head_range(model_config, Shard(rank, shard.world))
            kv_shards.append(KVShard(start, list(cache.unbind(0))))
            whole.append(cache)
        tp = TensorParallelGroup(shard.world)
        tp.spawn(Path(model_dir), config, whole[1:])
    try:
        if tp is not None:
            collectives = tp.join()
        model = load_model(
            model_dir,
            config.dtype,
            config.quantization,
            shard,
            collectives,
            config.bf16_matmul,
            deterministic=config.deterministic,
        )
        if tp is not None:
            tp.wait_ready()
            tp.watch()
    except BaseException:
        if tp is not None:
            tp.close()
        raise
    if not kv_shards:
        caches = allocate_kv_cache(local, num_blocks, block_size, dtype, lazy)
        kv_shards.append(KVShard(0, caches))
    keep_step_memory()  # a pdserve process: from now on, steps' temporaries of any size reused
    return LoadedModel(model_config, model, num_blocks, size.window_blocks, kv_shards, tp)
