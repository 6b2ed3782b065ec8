"""Tensor parallelism on one node: the engine's process is rank 0 and owns scheduling; ranks
1..N-1 are worker processes, each holding its shard of the weights and the KV of its heads for
the same block ids. Rank 0 allocates every rank's KV in shared memory and hands each worker
its own, so the node's transport (on rank 0) reads and writes any rank's heads. Every step
rank 0 sends the step's inputs (the plan: token ids, positions, slots, block tables) to each
worker over a pipe, then all ranks run the forward pass together, joined by a gloo group of
their own on loopback (NCCL would take the same calls on GPUs).

Failure: a worker that dies breaks the collective of the step in flight (gloo reports the
closed connection; a stalled rank is cut off by the collective timeout); rank 0 then marks the
group broken and every later step fails at once naming the rank. A worker whose rank 0 died
sees its pipe close and exits; `close` ends the workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdserve.config import EngineConfig
from pdserve.model.parallel import Shard

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 30.0  # a collective longer than this means a rank is stuck
READY_TIMEOUT_S = 300.0  # a worker importing torch and loading its shard
DEATH_GRACE_S = 2.0  # after a broken collective: how long a dying rank may take to be gone


class TensorParallelError(RuntimeError):
    """The tensor-parallel group cannot run a step (a rank died, stalled or failed to load)."""


def _store(port: int, world: int, master: bool) -> dist.TCPStore:
    """The group's rendezvous on loopback (rank 0 serves it; port 0: a free one)."""
    return dist.TCPStore(
        "127.0.0.1",
        port,
        world,
        is_master=master,
        timeout=timedelta(seconds=READY_TIMEOUT_S),
        wait_for_workers=False,
    )


class GlooCollectives:
    """All-reduce and gather over a gloo group of the node's ranks, on loopback."""

    def __init__(self, rank: int, world: int, store: dist.TCPStore) -> None:
        self.world = world
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private in torch's stubs, public at run time
        # The ranks of a node talk over loopback only (gloo would otherwise resolve the host
        # name to a network interface).
        options._devices = [dist.ProcessGroupGloo.create_device(interface="lo")]
        options._timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        self.group: Any = dist.ProcessGroupGloo(store, rank, world, options)  # untyped stubs
        self.store = store

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.group.allreduce([tensor]).wait()

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        self.group.allgather([parts], [tensor.contiguous()]).wait()
        return torch.cat(parts, dim=-1)


def tensor_parallel_threads(world: int) -> int | None:
    """Torch threads per rank when not set: the cores shared out (None: torch's default)."""
    return max(1, (os.cpu_count() or 1) // world) if world > 1 else None


def _replace_kernel(
    inputs: Any,
    kernel: Any,
    prefill_kernel: Any = None,
    fresh_kernel: Any = None,
    writer: Any = None,
) -> Any:
    """Step inputs with other attention kernels, for decode, for runs over a cached prefix and
    for fresh prompts, and another K/V writer (compiled functions: each rank has its own, and
    they do not travel through a pipe)."""
    meta = inputs.meta
    if meta.kv_writer is not writer:
        meta = dataclasses.replace(meta, kv_writer=writer)
    for field in ("decode", "window_decode"):
        decode = getattr(meta, field)
        if decode is not None and decode.kernel is not kernel:
            meta = dataclasses.replace(meta, **{field: dataclasses.replace(decode, kernel=kernel)})
    if any(s.kernel is not prefill_kernel or s.fresh is not fresh_kernel for s in meta.prefills):
        prefills = tuple(
            dataclasses.replace(seg, kernel=prefill_kernel, fresh=fresh_kernel)
            for seg in meta.prefills
        )
        meta = dataclasses.replace(meta, prefills=prefills)
    return inputs if meta is inputs.meta else dataclasses.replace(inputs, meta=meta)


class TensorParallelGroup:
    """Rank 0's handle on its workers: `spawn` starts them, `join` makes rank 0's side of the
    group, `wait_ready` waits until each has its shard and cache, `send_step` hands each the
    next step, `close` ends them."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.store = _store(0, world, master=True)  # bound now: the workers are told its port
        self._procs: list[BaseProcess] = []
        self._pipes: list[Connection] = []
        self.broken: str | None = None
        self._lock = threading.Lock()
        self.on_broken: Callable[[], None] = lambda: None  # any thread, once the group broke
        self._closing, self._close_signal = mp.Pipe(duplex=False)
        self._watcher: threading.Thread | None = None

    def spawn(self, model_dir: Path, config: EngineConfig, caches: list[torch.Tensor]) -> None:
        """Start ranks 1..N-1; `caches[r - 1]` is rank r's KV (shared memory, all layers)."""
        ctx = mp.get_context("spawn")
        port = self.store.port
        for rank, cache in enumerate(caches, start=1):
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world, port, str(model_dir), config, cache, theirs),
                name=f"pdserve-tp-rank{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._pipes.append(ours)

    def watch(self) -> None:
        """From now on a worker's death breaks the group at once (not at the next step's
        collective): the other workers are ended and `on_broken` is called, so the requests
        in flight fail now, their transfers included."""
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        ended = wait([self._closing, *(p.sentinel for p in self._procs)])
        if self._closing not in ended:
            self._break(ended, "a rank ended")

    def _break(self, ended: list[Any], fallback: str) -> None:
        """Mark the group broken (the first cause stands), naming the rank that died if one
        did (`ended`: the sentinels seen closed). Reaping is serialized: a process reaped by
        one thread would look alive to another."""
        with self._lock:
            if self.broken:
                return
            for proc in self._procs:
                if proc.sentinel in ended:  # its files closed; its exit follows at once
                    proc.join(DEATH_GRACE_S)
            dead = [r for r, p in enumerate(self._procs, start=1) if p.exitcode is not None]
            what = f"rank {dead[0]} died" if dead else fallback
            self.broken = f"tensor-parallel group broken: {what}"
        logger.error("%s", self.broken)
        for proc in self._procs:  # every rank ends: none waits in a collective that cannot end
            if proc.exitcode is None:
                proc.kill()
        self.on_broken()

    def join(self) -> GlooCollectives:
        return GlooCollectives(0, self.world, self.store)

    def wait_ready(self) -> None:
        for rank, pipe in enumerate(self._pipes, start=1):
            if not pipe.poll(READY_TIMEOUT_S):
                raise TensorParallelError(f"tensor-parallel rank {rank} not ready in time")
            try:
                message = pipe.recv_bytes().decode()
            except (EOFError, OSError):
                message = "exited while loading"
            if message != "ready":
                raise TensorParallelError(f"tensor-parallel rank {rank}: {message}")

    def send_step(self, inputs: Any) -> None:
        if self.broken:
            raise TensorParallelError(self.broken)
        payload = pickle.dumps(_replace_kernel(inputs, None), protocol=pickle.HIGHEST_PROTOCOL)
        for pipe in self._pipes:
            try:
                pipe.send_bytes(payload)
            except OSError as e:  # its end closed: the rank is gone
                raise self.step_failed(e) from e

    def step_failed(self, error: BaseException) -> TensorParallelError:
        """After a failed collective: the group is broken; name the rank that died (its
        connection can close a moment before its process is seen to end: wait for that)."""
        ended = wait([p.sentinel for p in self._procs], timeout=DEATH_GRACE_S)
        self._break(ended, f"a collective failed ({error})")
        return TensorParallelError(self.broken)

    def close(self, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(OSError):
            self._close_signal.send_bytes(b"")  # the watcher ends: these exits are expected
        if self._watcher is not None:
            self._watcher.join(timeout_s)
        for pipe in self._pipes:
            with contextlib.suppress(OSError):
                pipe.send_bytes(b"")  # stop
        for proc in self._procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout_s)
        for pipe in self._pipes:
            pipe.close()
        self._procs.clear()
        self._pipes.clear()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]


def _worker_main(
    rank: int,
    world: int,
    port: int,
    model_dir: str,
    config: EngineConfig,
    cache: torch.Tensor,
    pipe: Connection,
) -> None:
    from pdserve.model.fused import (
        fresh_prefill_kernel,
        kv_writer,
        paged_decode_kernel,
        paged_prefill_kernel,
    )
    from pdserve.model.heap import keep_freed_memory, keep_step_memory
    from pdserve.model.loader import load_model

    keep_freed_memory()  # as its rank 0's pdserve process
    # Rank 0 ends the workers: a signal sent to the whole process group (Ctrl-C, a service
    # manager's stop) must not end one before rank 0 fails what runs as "shutting down".
    # A worker whose rank 0 is gone sees its pipe close and exits.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        torch.set_num_threads(config.num_threads or tensor_parallel_threads(world) or 1)
        collectives = GlooCollectives(rank, world, _store(port, world, master=False))
        shard = Shard(rank, world)
        model = load_model(
            model_dir, config.dtype, config.quantization, shard, collectives, config.bf16_matmul
        )
        keep_step_memory()  # as its rank 0, once loaded
        caches = list(cache.unbind(0))  # per layer, views of the memory rank 0 shares
        kernel = paged_decode_kernel() if config.attention_backend == "auto" else None
        prefill_kernel = None if kernel is None else paged_prefill_kernel()
        fresh_kernel = None if kernel is None else fresh_prefill_kernel()
        writer = None if kernel is None else kv_writer()
    except Exception as e:
        pipe.send_bytes(f"failed to load: {e}\n{traceback.format_exc()}".encode())
        return
    pipe.send_bytes(b"ready")
    with torch.inference_mode():
        while True:
            try:
                payload = pipe.recv_bytes()
            except (EOFError, OSError):
                return  # rank 0 is gone
            if not payload:
                return
            inputs = _replace_kernel(
                pickle.loads(payload), kernel, prefill_kernel, fresh_kernel, writer
            )
            hidden = model(
                inputs.input_ids, inputs.positions, caches, inputs.meta, keep=inputs.sample_rows
            )
            model.compute_logits(hidden)
