"""What the `pdserve` command's flags become: the frozen configs (`engine_config`,
`node_config`, `http_config`, `router_config`, `cluster_config`), the keys and secrets they
name, and the refusal to expose HTTP beyond loopback without a key. Nothing below the CLI reads
a flag or the environment."""

from __future__ import annotations

import argparse
import logging
import os
import shlex

from pdserve import config as c
from pdserve.config import ClusterConfig, EngineConfig, HttpConfig, NodeConfig, RouterConfig


def api_key(args: argparse.Namespace) -> c.Secret | None:
    """The HTTP API key: --api-key-file, --api-key or $PDSERVE_API_KEY."""
    return _key(args.api_key, args.api_key_file, "PDSERVE_API_KEY", "--api-key")


def _key(value: str | None, path: str | None, env: str, flag: str) -> c.Secret | None:
    if value and path:
        raise c.ConfigError(f"give {flag} or {flag}-file, not both")
    if path:
        return c.Secret.from_file(path, min_bytes=1)
    key = value or os.environ.get(env)
    return c.Secret(key.encode(), min_bytes=1) if key else None


def check_http_exposure(host: str, key: c.Secret | None, insecure: bool, what: str) -> None:
    """An HTTP API beyond loopback needs a key, unless the user said --insecure."""
    if key is None and not c.is_loopback(host):
        if not insecure:
            raise c.ConfigError(
                f"{what} on --host {host} would serve anyone on the network: give "
                "--api-key-file (or PDSERVE_API_KEY), or pass --insecure"
            )
        logging.getLogger("pdserve").warning("--insecure: %s on %s has no API key", what, host)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    cache = c.CacheConfig(
        args.block_size,
        args.kv_cache_memory * c.MIB,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    scheduler = c.SchedulerConfig(
        args.max_num_seqs,
        args.max_num_batched_tokens,
        args.max_model_len,
        args.prefill_step_tokens,
    )
    return EngineConfig(
        args.model,
        args.dtype,
        args.threads,
        str(c.default_cache_dir()),
        cache,
        scheduler,
        args.attention_backend,
        args.quantization,
        args.revision,
        args.tensor_parallel_size,
        bf16_matmul=args.bf16_matmul,
        deterministic=args.deterministic,
        canary_rate=args.canary_rate,
    )


def _secret_file(args: argparse.Namespace) -> c.Secret | None:
    path = args.cluster_secret_file or os.environ.get("PDSERVE_CLUSTER_SECRET_FILE")
    return c.Secret.from_file(path) if path else None


def tls_files(args: argparse.Namespace) -> c.TlsFiles:
    if bool(args.tls_cert) != bool(args.tls_key):
        raise c.ConfigError("--tls-cert and --tls-key go together")
    return c.TlsFiles(args.tls_cert, args.tls_key, args.tls_ca)


def traces_endpoint(args: argparse.Namespace) -> str | None:
    """Where OpenTelemetry traces go: the flag, else OpenTelemetry's own variables (the
    traces endpoint as it is, the general one with the signal's path); None (off) when neither
    is set or `OTEL_SDK_DISABLED` / `OTEL_TRACES_EXPORTER=none` turn tracing off."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    if args.otlp_traces_endpoint:
        return str(args.otlp_traces_endpoint)
    if env.get("OTEL_TRACES_EXPORTER", "").lower() == "none":
        return None
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return base.rstrip("/") + "/v1/traces" if base else None


def node_config(args: argparse.Namespace) -> NodeConfig:
    config = NodeConfig(
        grpc_host=args.grpc_host,
        port=args.grpc_port,
        transfer_host=args.transfer_host,
        transfer_port=args.transfer_port,
        transfer_backend=args.transfer_backend,
        advertise_host=args.advertise_host,
        prefill_addresses=tuple(args.prefill or ()),
        min_prompt_tokens=args.min_prefill_tokens,
        prefill_failure=args.prefill_failure,
        prefill_placement=args.prefill_placement,
        request_timeout_s=args.request_timeout,
        probe_cap_s=args.probe_cap,
        max_pending=args.max_pending,
        max_waiting=args.max_waiting,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        reader_idle_timeout_s=args.reader_idle_timeout,
        max_transfer_connections=args.max_transfer_connections,
        testing_transfer_delay_s=args.testing_transfer_delay_ms / 1000,
        kv_checksum=args.kv_checksum,
        testing_corrupt_frame=args.testing_corrupt_kv_frame,
        cluster_secret=_secret_file(args),
        insecure=args.insecure,
        tls=tls_files(args),
        otlp_traces_endpoint=traces_endpoint(args),
    )
    problem = config.exposure_problem()
    if problem is not None:
        raise c.ConfigError(problem)
    if config.insecure and (
        not c.is_loopback(config.grpc_host) or not c.is_loopback(config.transfer_host)
    ):
        logging.getLogger("pdserve").warning(
            "--insecure: gRPC and KV transfer accept unauthenticated peers from the network"
        )
    return config


def http_config(args: argparse.Namespace) -> HttpConfig:
    key = api_key(args)
    check_http_exposure(args.host, key, args.insecure, "the HTTP API")
    return HttpConfig(
        host=args.host,
        port=args.http_port,
        served_model_name=c.served_model_name(args.model, args.served_model_name),
        api_key=key,
        router_key=_key(None, args.router_key_file, "PDSERVE_ROUTER_KEY", "--router-key"),
        open_paths=("/health",) if args.api_key_metrics else ("/health", "/metrics"),
        max_body_bytes=args.max_body_bytes,
        tls=tls_files(args),
        trust_special_tokens=args.trust_chat_special_tokens,
    )


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    # A local Ray started here listens on --node-ip: beyond loopback only with Ray's own token
    # auth (Ray runs code for anyone reaching its ports), unless the user said --insecure.
    local_ray = args.address is None and not c.is_loopback(args.node_ip)
    if local_ray and not args.insecure and os.environ.get("RAY_AUTH_MODE") != "token":
        raise c.ConfigError(
            f"--node-ip {args.node_ip} would open Ray's ports to the network without "
            "authentication: set RAY_AUTH_MODE=token (and RAY_AUTH_TOKEN_PATH), or pass "
            "--insecure"
        )
    return ClusterConfig(
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        address=args.address,
        node_ip=args.node_ip,
        node_args=tuple(shlex.split(args.node_args)),
        prefill_port_base=args.prefill_port_base,
        decode_port_base=args.decode_port_base,
        cpus_per_node=args.cpus_per_node,
        prefill_resource=args.prefill_resource,
        decode_resource=args.decode_resource,
    )


def router_config(args: argparse.Namespace) -> RouterConfig:
    key = api_key(args)
    check_http_exposure(args.host, key, args.insecure, "the router")
    return RouterConfig(
        decodes=tuple(getattr(args, "decode", ()) or ()),
        prefills=tuple(getattr(args, "prefill", ()) or ()),
        policy=args.policy,
        local_prefill_below=args.local_prefill_below,
        prefill_queue_limit=args.prefill_queue_limit,
        tokenizer=getattr(args, "tokenizer", None),
        block_size=getattr(args, "block_size", 16),
        node_api_key=_key(
            args.node_api_key, args.node_api_key_file, "PDSERVE_NODE_API_KEY", "--node-api-key"
        ),
        api_key=key,
        max_body_bytes=args.max_body_bytes,
        tls=tls_files(args),
        max_connections=args.max_connections,
        request_timeout_s=args.request_timeout,
        cluster_secret=_secret_file(args),
        otlp_traces_endpoint=traces_endpoint(args),
    )
