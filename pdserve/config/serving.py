"""A node's configuration beyond its engine: its network and transfer settings, HTTP, the
router, a Ray cluster, TLS files, and the cluster secret (`Secret`, never printed)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.config.defaults import (
    DEFAULT_HOST,
    DEFAULT_HTTP_PORT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_RPCS,
    DEFAULT_MAX_PENDING,
    DEFAULT_MAX_TRANSFER_CONNECTIONS,
    DEFAULT_MIN_PREFILL_TOKENS,
    DEFAULT_MODEL_NAME,
    DEFAULT_PREFILL_FAILURE,
    DEFAULT_PREFILL_PLACEMENT,
    DEFAULT_PROBE_CAP_S,
    DEFAULT_READER_IDLE_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_ROUTER_MAX_CONNECTIONS,
    DEFAULT_TRANSFER_BACKEND,
    DEFAULT_TRANSFER_IDLE_S,
    MIN_SECRET_BYTES,
    ConfigError,
)

__all__ = [
    "Secret",
    "TlsFiles",
    "is_loopback",
    "is_wildcard",
    "NodeConfig",
    "HttpConfig",
    "RouterConfig",
    "ClusterConfig",
    "ROUTER_POLICIES",
]


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


def is_wildcard(host: str) -> bool:
    """Whether binding `host` listens on every address (so that it names none to peers)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


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
    prefill_failure: str = DEFAULT_PREFILL_FAILURE  # decode only: PREFILL_FAILURES
    prefill_placement: str = DEFAULT_PREFILL_PLACEMENT  # decode only: PREFILL_PLACEMENTS
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    probe_cap_s: float = DEFAULT_PROBE_CAP_S
    max_pending: int = DEFAULT_MAX_PENDING  # decode and colocated: requests in the engine
    max_waiting: int | None = None  # decode and colocated: requests not yet scheduled
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS
    reader_idle_timeout_s: float = DEFAULT_READER_IDLE_S  # decode and colocated
    max_transfer_connections: int = DEFAULT_MAX_TRANSFER_CONNECTIONS  # decode
    testing_transfer_delay_s: float = 0.0  # fault injection for tests: a slow network
    kv_checksum: bool = False  # frames carry a checksum per layer, verified by decode
    testing_corrupt_frame: int = 0  # fault injection for tests: flip a byte of that frame
    cluster_secret: Secret | None = None  # authenticates gRPC calls and KV transfer links
    insecure: bool = False  # allow gRPC/transfer beyond loopback without a secret
    tls: TlsFiles = field(default_factory=TlsFiles)  # gRPC: serve with cert/key, trust ca
    transfer_idle_timeout_s: float = DEFAULT_TRANSFER_IDLE_S  # decode
    otlp_traces_endpoint: str | None = None  # OpenTelemetry traces exported there; None: off

    def exposure_problem(self) -> str | None:
        """Why this node must not start as configured (a plane open to the network with no
        secret, or gRPC there without TLS, or a decode that would tell its prefill nodes a
        wildcard address), or None."""
        if self.prefill_addresses and is_wildcard(self.transfer_host) and not self.advertise_host:
            return (
                f"--transfer-host {self.transfer_host} listens on every address but names none: "
                "give --advertise-host, the address prefill nodes reach this node at"
            )
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
    otlp_traces_endpoint: str | None = None  # OpenTelemetry traces exported there; None: off


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
