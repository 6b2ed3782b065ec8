"""One NIXL agent per node (UCX backend) with the node's KV regions registered once, at start.

No NIXL progress thread: NIXL's own loops `poll` with a zero timeout and spins a core (the
lesson of `benchmarks/peers/vllm_peer.py`). Progress is made by the one pdserve thread that uses
the agent (the sender's or the receiver's) while it has transfers or notifications to wait for,
and it sleeps when it has none. Every agent call goes through one lock: the gRPC loop registers
peers while that thread transfers.

UCX picks its transports itself: shared memory / cross-memory attach on one host, RDMA verbs
where a NIC has them, TCP otherwise (`UCX_TLS`, `UCX_NET_DEVICES` select them).
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

import numpy as np

from pdserve.disagg.transport.regions import KVRegions, pair_runs
from pdserve.disagg.wire import nixl_peer, nixl_shard

logger = logging.getLogger(__name__)

MEM = "DRAM"


def import_nixl() -> Any:
    """NIXL's Python API, or a clear error naming how to install it."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise RuntimeError(
            "--transfer-backend nixl needs NIXL: pip install --no-deps nixl==1.5.1 "
            f"nixl-cu12==1.5.1 ({e})"
        ) from e
    return nixl_agent, nixl_agent_config


def run_descs(
    src_base: int, dst_base: int, src: list[int], dst: list[int], block_bytes: int
) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) descriptor arrays [(address, length, device)] moving block
    src[i] to dst[i]: one descriptor per run where both ids are consecutive."""
    runs = np.array(pair_runs(src, dst), dtype=np.uint64).reshape(-1, 3)
    width = np.uint64(block_bytes)
    size, zeros = runs[:, 2] * width, np.zeros(len(runs), dtype=np.uint64)
    src_descs = np.stack([np.uint64(src_base) + runs[:, 0] * width, size, zeros], 1)
    dst_descs = np.stack([np.uint64(dst_base) + runs[:, 1] * width, size, zeros], 1)
    return src_descs, dst_descs


def slice_descs(
    layer_base: int, blocks: list[int], num_heads: int, first: int, count: int, head_bytes: int
) -> np.ndarray:
    """Descriptors [(address, length, device)] of heads [first, first + count) of a shard
    holding `num_heads` heads (shard-relative), for `blocks` in order: K then V per block, the
    order of a frame's payload."""
    half = np.uint64(head_bytes // 2)  # K (or V) of one head in one block
    ids = np.array(blocks, dtype=np.uint64)
    k = np.uint64(layer_base) + ids * (half * np.uint64(2 * num_heads)) + np.uint64(first) * half
    addresses = np.stack([k, k + np.uint64(num_heads) * half], 1).reshape(-1)
    lengths = np.full(len(addresses), np.uint64(count) * half, dtype=np.uint64)
    return np.stack([addresses, lengths, np.zeros(len(addresses), dtype=np.uint64)], 1)


class NixlAgent:
    """The node's agent with `regions` registered (one region per layer tensor of each
    tensor-parallel rank)."""

    def __init__(self, role: str, regions: KVRegions) -> None:
        agent_cls, config_cls = import_nixl()
        self.name = f"pdserve-{role}-{uuid.uuid4().hex[:12]}"
        self.lock = threading.Lock()
        self.regions = regions
        self._agent = agent_cls(self.name, config_cls(enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL has no UCX backend here: --transfer-backend nixl needs it")
        # Per tensor-parallel rank, each layer's address (rank 0 maps every rank's KV).
        self.shard_addresses = [[c.data_ptr() for c in s.caches] for s in regions.shards]
        self.layer_addresses = self.shard_addresses[0]
        regs = [
            (c.data_ptr(), c.numel() * c.element_size(), 0, "")
            for s in regions.shards
            for c in s.caches
        ]
        self._registered = self._agent.register_memory(regs, MEM) if regs else None
        # All of it (memory keys included): what a peer needs to read this node's KV.
        self.metadata: bytes = self._agent.get_agent_metadata()
        # How to reach this agent and nothing of its memory: what a peer needs to notify it
        # (decode gives prefill only this, so a prefill node cannot write decode's KV).
        from nixl._api import nixlBind

        no_memory = nixlBind.nixlRegDList(self._agent.nixl_mems[MEM], [])
        self.connection_metadata: bytes = self._agent.get_partial_agent_metadata(
            no_memory, True, ["UCX"]
        )

    def peer_info(self) -> bytes:
        """What a decode needs to read this node's KV (a serialized NixlPeer)."""
        shards = [
            nixl_shard(s.head_start, s.num_heads, addresses, self.regions.head_bytes * s.num_heads)
            for s, addresses in zip(self.regions.shards, self.shard_addresses, strict=True)
        ]
        return nixl_peer(
            self.metadata,
            self.layer_addresses,
            self.regions.num_blocks,
            self.regions.block_bytes,
            shards,
        )

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's agent metadata (replacing what was known of it); its agent name."""
        with self.lock:
            name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        """Forget a peer: its connections close and transfers with it in flight end."""
        with self.lock:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # not known (any more): nothing to remove
                logger.debug("removing NIXL agent %s: %s", name, e)

    def send_notif(self, peer: str, message: bytes) -> None:
        with self.lock:
            self._agent.send_notif(peer, message)

    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications by sending agent (also progresses the agent's transfers)."""
        with self.lock:
            notifs = self._agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else k): v for k, v in notifs.items()}

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray) -> Any:
        """Post a READ of `remote` descriptors (peer memory) into `local` ones; its handle."""
        handle = None
        try:
            with self.lock:
                local_descs = self._agent.get_xfer_descs(local, MEM)
                remote_descs = self._agent.get_xfer_descs(remote, MEM)
                handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, peer)
                state = self._agent.transfer(handle)
        except Exception as e:  # NIXL raises its own errors (a peer disconnected, ...)
            state = f"ERR ({type(e).__name__}: {e})"
        if state.startswith("ERR"):
            if handle is not None:
                self.release(handle)
            raise OSError(f"NIXL could not post a read from {peer}: {state}")
        return handle

    def state(self, handle: Any) -> str:
        """DONE, PROC or ERR (NIXL raises for some failures, e.g. a peer disconnected)."""
        try:
            with self.lock:
                return str(self._agent.check_xfer_state(handle))
        except Exception as e:
            logger.warning("NIXL transfer failed: %s: %s", type(e).__name__, e)
            return "ERR"

    def release(self, handle: Any) -> bool:
        """Release a finished transfer, or abort one in flight; False if it cannot be yet."""
        with self.lock:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception as e:
                logger.warning("NIXL transfer not released yet: %s", e)
                return False
        return True

    def close(self) -> None:
        with self.lock:
            if self._registered is not None:
                self._agent.deregister_memory(self._registered)
                self._registered = None
