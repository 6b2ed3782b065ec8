"""The decode node, the entrance, assembled: an engine in decode mode, the KV receiver prefill
nodes push into, the prefill client that calls them, and gRPC `DecodeService` (the client entry,
`api.grpc_entry`) in front. Stopping it fails every request in flight with "the node is shutting
down"."""

from __future__ import annotations

import asyncio
import logging

from pdserve.api.grpc_entry import DecodeServicer
from pdserve.disagg.kv_loader import KVLayout, KVLoader, SplitPolicy
from pdserve.disagg.kv_receiver import KVReceiver
from pdserve.disagg.prefill_client import PrefillClient, ProbePolicy, Registration
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.disagg.resource_store import ResourceStore
from pdserve.disagg.transport import make_receiver
from pdserve.disagg.transport.base import TransferReceiver
from pdserve.disagg.transport.regions import KVRegions
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.snapshot import NodeSnapshot
from pdserve.serve.engine_node import EngineNode

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0


class DecodeNode(EngineNode):
    role = "decode"
    # Set by `start`.
    receiver: TransferReceiver | None = None
    kv_receiver: KVReceiver | None = None
    client: PrefillClient | None = None
    transfer_address = ""
    _probe_task: asyncio.Task[None] | None = None

    def knows_prefill(self, address: str) -> bool:
        return self.client is not None and self.client.knows(address)

    async def readdress_prefill(self, old: str, new: str) -> bool:
        if self.client is None:
            return False
        gone = self.client.readdress(old, new)
        if gone is None:
            return False
        logger.warning("prefill node %s is at %s now", old, new)
        await gone.channel.close(grace=None)
        return True

    async def start(self) -> None:
        engine = await self._start_engine("decode-engine")
        store = ResourceStore(
            on_ready=lambda key: self.engine_thread.wake(), on_register=self._wake_receiver
        )
        regions = KVRegions.sharded(engine.kv_shards)
        self.client = self._prefill_client(engine, store, regions)
        engine.attach_connector(self._loader(engine, store, regions, self.client))
        cfg = self.config
        self.grpc = self._grpc_server()
        servicer = DecodeServicer(self, self.metrics, cfg.max_concurrent_rpcs)
        add = pb_grpc.add_DecodeServiceServicer_to_server  # generated: unannotated
        add(servicer, self.grpc.server)  # type: ignore[no-untyped-call]  # generated gRPC code
        self.engine_thread.start()
        await self.grpc.start()
        self._probe_task = asyncio.create_task(self._probe_loop())
        logger.info(
            "decode node serving on %s (KV receiver %s, prefill %s)",
            self.grpc.address,
            self.transfer_address,
            ", ".join(cfg.prefill_addresses),
        )

    def _wake_receiver(self) -> None:
        if self.receiver is not None:  # a NIXL receiver polling slowly while idle polls now
            self.receiver.wake()

    def _prefill_client(
        self, engine: LLMEngine, store: ResourceStore, regions: KVRegions
    ) -> PrefillClient:
        """The KV receiver prefill nodes push into, and the client that registers it with them
        (each probe) and calls them."""
        cfg = self.config
        kv_receiver = KVReceiver(
            store,
            regions,
            on_frame=self.metrics.on_frame,
            verify=cfg.kv_checksum,
            testing_corrupt_frame=cfg.testing_corrupt_frame,
        )
        self.kv_receiver = kv_receiver
        self.receiver = make_receiver(cfg, kv_receiver, regions, store.expecting)
        self.transfer_address = self.receiver.advertised(cfg.advertise_host)
        registration = Registration(
            self.transfer_address,
            cfg.transfer_backend,
            self.receiver.metadata(),
            self.receiver.add_peer,
        )
        return PrefillClient(
            list(cfg.prefill_addresses),
            self._fingerprint(engine),
            registration,
            ProbePolicy(cap_s=cfg.probe_cap_s),
            (cfg.cluster_secret, cfg.tls),
        )

    def _loader(
        self, engine: LLMEngine, store: ResourceStore, regions: KVRegions, client: PrefillClient
    ) -> KVLoader:
        """Decode's connector: which requests to split, and their handoffs."""
        cfg = self.config
        layout = KVLayout(
            engine.model_config.num_layers,
            engine.block_size,
            regions.block_bytes,
            tuple(regions.bounds),
        )
        return KVLoader(
            store,
            client,
            asyncio.get_running_loop(),
            layout,
            SplitPolicy(
                cfg.min_prompt_tokens,
                cfg.request_timeout_s,
                cfg.prefill_failure == "local",
                cfg.prefill_placement,
            ),
            on_handoff=self.metrics.on_handoff,
        )

    async def _probe_loop(self) -> None:
        assert self.client is not None
        while True:
            await self.client.probe_all()
            await asyncio.sleep(PROBE_INTERVAL_S)

    def health(self) -> tuple[bool, str]:
        if self.client is None or self._thread is None:
            return False, "starting"
        if not self.client.has_verified():
            # A node that computes prompts itself when no prefill node can (--prefill-failure
            # local) serves all the same. (Its 503 would also read as "broken for good" to a
            # Ray actor, which would then restart it over and over while its prefill nodes
            # are away, or moved: tests/router/test_namespaces.py.)
            if self.config.prefill_failure == "local":
                return True, "no prefill node reachable: prompts are computed here"
            return False, "no prefill node reachable"
        return True, "ok"

    def endpoints(self) -> list[str]:
        return [*super().endpoints(), f"transfer={self.transfer_address}"]

    def snapshot(self) -> NodeSnapshot:
        snap = super().snapshot()
        if self.receiver is not None:
            snap.transfer_connections = dict(self.receiver.stats())
        if self.kv_receiver is not None and self.kv_receiver.verify:
            snap.kv_checksum_failures = dict(self.kv_receiver.checksum_failures)
        return snap

    async def stop(self) -> None:
        """Safe whatever started: each part is stopped only if it exists."""
        if self._probe_task is not None:
            self._probe_task.cancel()
        await super().stop()  # the engine first: calls in flight get a clear error
        if self.receiver is not None:
            self.receiver.stop()
        if self.client is not None:
            await self.client.close()
