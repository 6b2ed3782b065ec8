"""What every node needs: the engine built from configs on its own thread, the model
fingerprint peers compare, and a gRPC server that can be stopped whatever started."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.config import EngineConfig
from pdserve.disagg.prefill_client import GRPC_OPTIONS
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeConfig:
    host: str = "127.0.0.1"
    port: int = 0  # gRPC; 0 picks a free port
    transfer_port: int = 0
    transfer_backend: str = "tcp"
    advertise_host: str | None = None  # decode: the address prefill nodes push KV to
    prefill_addresses: tuple[str, ...] = ()  # decode only
    min_prompt_tokens: int = 8  # decode only: shorter prompts are prefilled locally
    request_timeout_s: float = 60.0
    probe_cap_s: float = 2.0
    testing_transfer_delay_s: float = 0.0  # fault injection for tests: a slow network


def fingerprint(engine: LLMEngine) -> pb.ModelFingerprint:
    cfg = engine.model_config
    return pb.ModelFingerprint(
        architecture=cfg.architecture,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=engine.config.dtype,
        block_size=engine.block_size,
    )


class GrpcServer:
    """A grpc.aio server on host:port (port 0: a free one); `stop` is safe before `start`."""

    def __init__(self, host: str, port: int) -> None:
        self.server: grpc.aio.Server | None = grpc.aio.server(options=GRPC_OPTIONS)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        self.address = f"{host}:{self.port}"
        self.started = False

    async def start(self) -> None:
        assert self.server is not None
        await self.server.start()
        self.started = True

    async def stop(self, grace: float = 1.0) -> None:
        if self.server is not None and self.started:
            await self.server.stop(grace)
        self.server = None


class EngineNode:
    """What prefill and decode nodes share: configs, the engine thread, the gRPC server."""

    def __init__(self, engine_config: EngineConfig, model_dir: Path, config: NodeConfig) -> None:
        self.config = config
        self.engine_config = engine_config
        self.model_dir = model_dir
        self.engine_thread_: EngineThread | None = None
        self.grpc: GrpcServer | None = None

    @property
    def engine_thread(self) -> EngineThread:
        assert self.engine_thread_ is not None, "node not started"
        return self.engine_thread_

    @property
    def engine(self) -> LLMEngine:
        return self.engine_thread.engine
