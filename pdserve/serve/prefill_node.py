"""The prefill node, assembled: an engine in prefill mode whose KV sender pushes every layer
to the decode node named in each Prefill call, behind gRPC `PrefillService` (disagg)."""

from __future__ import annotations

import logging
from concurrent.futures import Future

from pdserve.config import DEFAULT_PREFILL_STEP_TOKENS
from pdserve.disagg.kv_sender import KVSender
from pdserve.disagg.prefill_server import PrefillServicer, refusal
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.disagg.send_target import Complete, SendTarget
from pdserve.disagg.transport import make_sender
from pdserve.disagg.transport.base import TransferSender
from pdserve.disagg.transport.regions import KVRegions
from pdserve.engine.failure import Failure
from pdserve.engine.kv_cache import layer_windows
from pdserve.engine.sequence import RequestOptions, SamplingParams
from pdserve.serve.engine_node import EngineNode

logger = logging.getLogger(__name__)


class PrefillNode(EngineNode):
    role = "prefill"
    accepts_requests = False  # decode calls it; clients do not
    prefill_step_tokens = DEFAULT_PREFILL_STEP_TOKENS  # prompts first come, first served
    # Set by `start`.
    _transport: TransferSender | None = None
    _kv_sender: KVSender | None = None
    fingerprint: pb.ModelFingerprint

    @property
    def block_size(self) -> int:
        return self.engine_config.cache.block_size

    @property
    def hash_key(self) -> bytes:
        return self.engine_config.cache.hash_key

    @property
    def transfer_backend(self) -> str:
        return self.config.transfer_backend

    @property
    def sender(self) -> KVSender:
        assert self._kv_sender is not None, "node not started"
        return self._kv_sender

    async def start(self) -> None:
        engine = await self._start_engine("prefill-engine")
        self._transport = make_sender(
            self.config.transfer_backend,
            KVRegions.sharded(engine.kv_shards),
            self.config.testing_transfer_delay_s,
            self.config.cluster_secret,
            checksum=self.config.kv_checksum,
        )
        self._kv_sender = KVSender(
            self._transport,
            engine.model_config.num_layers,
            engine.block_size,
            wake=self.engine_thread.wake,
            windows=layer_windows(engine.model_config),
        )
        engine.attach_connector(self._kv_sender)
        self.fingerprint = self._fingerprint(engine)
        self.grpc = self._grpc_server()
        servicer = PrefillServicer(self, self.config.max_concurrent_rpcs)
        add = pb_grpc.add_PrefillServiceServicer_to_server  # generated: unannotated
        add(servicer, self.grpc.server)  # type: ignore[no-untyped-call]  # generated gRPC code
        self.engine_thread.start()
        await self.grpc.start()
        logger.info("prefill node serving on %s", self.grpc.address)

    def admit(
        self,
        target: SendTarget,
        tokens: list[int],
        params: SamplingParams,
        on_complete: Complete,
        options: RequestOptions,
    ) -> Future[None]:
        """Register the send target and add the request, on the engine thread."""
        sender, engine = self.sender, self._started_engine

        def admit() -> None:
            sender.add_target(target, on_complete)
            try:
                engine.add_request(target.unique_key, tokens, params, options)
            except Exception:
                sender.remove_target(target.unique_key)
                raise

        return self.engine_thread.call(admit)

    def migrate(
        self, target: SendTarget, tokens: list[int], handle: str, on_complete: Complete
    ) -> Future[None]:
        """A prefill node pauses no streams: nothing to migrate from here."""
        return refusal("this is a prefill node: it holds no streams to migrate")

    def cancel(self, unique_key: str, failure: Failure) -> None:
        """Stop sending and abort the request (any thread)."""
        self.sender.cancel(unique_key, failure)
        self.engine_thread.abort(unique_key)

    async def stop(self) -> None:
        """Safe whatever started: each part is stopped only if it exists. The engine stops
        first, so calls in flight end with "the node is shutting down", not a bare cancel."""
        await super().stop()
        if self._transport is not None:
            self._transport.close()
