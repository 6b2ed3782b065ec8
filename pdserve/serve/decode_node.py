"""The decode node, the entrance, assembled: an engine in decode mode, the KV receiver prefill
nodes push into, the prefill client that calls them, and gRPC `DecodeService` (the client entry,
`api.grpc_entry`) in front. Stopping it fails every request in flight with "the node is shutting
down"."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future

from pdserve.api.grpc_entry import DecodeServicer
from pdserve.disagg.kv_loader import KVLayout, KVLoader, SplitPolicy
from pdserve.disagg.kv_receiver import KVReceiver
from pdserve.disagg.kv_sender import KVSender
from pdserve.disagg.prefill_client import PrefillClient, ProbePolicy, Registration
from pdserve.disagg.prefill_server import PrefillServicer, refusal
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.disagg.resource_store import ResourceStore
from pdserve.disagg.send_target import Complete, PrefillOutcome, SendTarget
from pdserve.disagg.transport import make_receiver, make_sender
from pdserve.disagg.transport.base import TransferReceiver, TransferSender
from pdserve.disagg.transport.regions import KVRegions
from pdserve.engine.failure import Failure
from pdserve.engine.kv_cache import layer_windows
from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import Guide, RequestOptions, SamplingParams
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
    migration_address = ""  # where other decode nodes fetch streams paused here
    _probe_task: asyncio.Task[None] | None = None
    _migration_transport: TransferSender | None = None
    _migration_host: MigrationHost | None = None

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
        self._serve_migrations(engine, regions)
        self.engine_thread.start()
        await self.grpc.start()
        self._probe_task = asyncio.create_task(self._probe_loop())
        logger.info(
            "decode node serving on %s (KV receiver %s, prefill %s)",
            self.grpc.address,
            self.transfer_address,
            ", ".join(cfg.prefill_addresses),
        )

    def _serve_migrations(self, engine: LLMEngine, regions: KVRegions) -> None:
        """Streams paused here (`migrate_out`) are fetched by other decode nodes through
        `PrefillService` on this node's gRPC server, their KV sent by a KV sender of its own
        (over TCP; with NIXL streams move by recompute: `migrate_out` pauses none)."""
        cfg = self.config
        assert self.grpc is not None
        if cfg.transfer_backend != "tcp":
            return
        self._migration_transport = make_sender(
            "tcp",
            regions,
            cfg.testing_transfer_delay_s,
            cfg.cluster_secret,
            checksum=cfg.kv_checksum,
        )
        loop = asyncio.get_running_loop()

        def wake() -> None:  # a send ended (a sender thread): its outcome is reported here
            loop.call_soon_threadsafe(sender.poll_finished_sends)

        model = engine.model_config
        sender = KVSender(
            self._migration_transport,
            model.num_layers,
            engine.block_size,
            wake,
            windows=layer_windows(model),
        )
        self._migration_host = MigrationHost(self, sender, self._fingerprint(engine))
        servicer = PrefillServicer(self._migration_host, cfg.max_concurrent_rpcs)
        add = pb_grpc.add_PrefillServiceServicer_to_server  # generated: unannotated
        add(servicer, self.grpc.server)  # type: ignore[no-untyped-call]  # generated gRPC code
        host = cfg.advertise_host or cfg.grpc_host
        self.migration_address = f"{host}:{self.grpc.port}"

    async def migrate_out(self, request_ids: list[str]) -> list[str]:
        """Pause those of `request_ids` that are between two decode steps and hand them over
        (`migration_address` serves their KV); the ids paused (none where this node sends no
        KV: NIXL)."""
        if self._migration_host is None:
            return []
        thread = self.engine_thread

        def pause() -> list[str]:
            outputs = thread.engine.migrate_out(request_ids)
            for out in outputs:
                thread.deliver(out)
            return [out.request_id for out in outputs]

        return await asyncio.wrap_future(thread.call(pause))

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
            layer_windows(engine.model_config),
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
            on_transfer=self.metrics.on_transfer,
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
        if self._migration_host is not None and self._migration_host.sent:
            snap.migrations = {**(snap.migrations or {}), "out": self._migration_host.sent}
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
        if self._migration_transport is not None:
            self._migration_transport.close()
        if self.client is not None:
            await self.client.close()


class MigrationHost:
    """What `PrefillService` serves on a decode node (`PrefillHost`): the KV of streams paused
    here for another decode node (live migration), sent from their held blocks, computing
    nothing; it prefills no prompts for others."""

    def __init__(
        self, node: DecodeNode, sender: KVSender, fingerprint: pb.ModelFingerprint
    ) -> None:
        self.node = node
        self._sender = sender
        self.fingerprint = fingerprint
        self.sent = 0  # streams whose KV went to another node

    @property
    def transfer_backend(self) -> str:
        return "tcp"

    @property
    def block_size(self) -> int:
        return self.node.engine_config.cache.block_size

    @property
    def hash_key(self) -> bytes:
        return self.node.engine_config.cache.hash_key

    @property
    def sender(self) -> KVSender:
        return self._sender

    def health(self) -> tuple[bool, str]:
        return EngineNode.health(self.node)  # its engine's; the prefill nodes' do not matter

    def snapshot(self) -> NodeSnapshot:
        return self.node.snapshot()

    def kv_events(self) -> KVEventLog:
        return self.node.kv_events()

    async def compile_guide(self, guide: Guide) -> None:
        await self.node.compile_guide(guide)

    def admit(
        self,
        target: SendTarget,
        tokens: list[int],
        params: SamplingParams,
        on_complete: Complete,
        options: RequestOptions,
    ) -> Future[None]:
        return refusal("this is a decode node: it prefills no prompts for others")

    def migrate(
        self, target: SendTarget, tokens: list[int], handle: str, on_complete: Complete
    ) -> Future[None]:
        thread = self.node.engine_thread

        def done(outcome: PrefillOutcome) -> None:
            thread.call(lambda: thread.engine.release_migrated(handle))
            if outcome.failure is None:
                self.sent += 1
            on_complete(outcome)

        def take() -> None:
            blocks, filled = thread.engine.migration_blocks(handle, tokens)
            try:
                self._sender.send_computed(target, blocks, filled, done)
            except BaseException:
                thread.engine.release_migrated(handle)
                raise

        return thread.call(take)

    def cancel(self, unique_key: str, failure: Failure) -> None:
        self._sender.cancel(unique_key, failure)  # its blocks are freed once the writes end
