"""The `pdserve` command's flags: the one place they are defined (`configs.py` reads them into
configs)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pdserve import config as c

DESCRIPTION = """\
pdserve serves language models with prefill/decode disaggregation: the prompt is computed on
a prefill node, tokens are generated on a decode node (which serves an OpenAI-compatible API),
and the KV cache moves between them layer by layer while prefill still computes."""
EXAMPLES = """examples:
  pdserve serve                          # SmolLM2-135M on http://127.0.0.1:8000, disaggregated
  pdserve serve --role both              # the same model, colocated (no disaggregation)
  pdserve generate "Write a haiku about the sea."
  pdserve bench serve --num-prompts 20   # load-test the server above
"""


# fmt: off
def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=c.DEFAULT_MODEL,
                   help="'default' (SmolLM2-135M-Instruct), 'gemma3-270m' (Gemma 3 270M, "
                   "sliding-window attention), a model directory, a .gguf file, "
                   "or a Hugging Face hub id (org/name; HF_HOME, HF_HUB_OFFLINE apply)")
    p.add_argument("--revision", default=None,
                   help="a hub model's branch, tag or commit (default: main)")
    p.add_argument("--dtype", default=c.DEFAULT_DTYPE, choices=c.DTYPES)
    p.add_argument("--kv-cache-memory", type=int, default=c.DEFAULT_KV_CACHE_MIB, metavar="MIB",
                   help="KV cache budget in MiB")
    p.add_argument("--block-size", type=int, default=c.DEFAULT_BLOCK_SIZE)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=c.DEFAULT_MAX_NUM_SEQS)
    p.add_argument("--max-num-batched-tokens", type=int, default=c.DEFAULT_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--prefill-step-tokens", type=int, default=None, metavar="N",
                   help="no new prompt joins a step once it holds N prompt tokens (default: "
                   f"{c.DEFAULT_PREFILL_STEP_TOKENS} on a prefill node, where prompts then reach "
                   "decode one by one; elsewhere only --max-num-batched-tokens limits them)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--attention-backend", default="auto", choices=c.ATTENTION_BACKENDS,
                   help="decode attention: the compiled CPU kernel where it builds (auto), or "
                   "plain torch")
    p.add_argument("--quantization", default="none", choices=c.QUANTIZATIONS,
                   help="weight-only quantization of the linear layers (int8: per row; int4: "
                   "groups of 32, output projection int8); prefill and decode must agree")
    p.add_argument("--bf16-matmul", default="auto", choices=c.BF16_MATMULS,
                   help="how bf16 weights are multiplied: auto = pdserve's compiled kernels "
                   "(the layers in panels, widened to fp32 as read where the CPU has no native "
                   "bf16; the output projection's batches there in fp32, its weight also held "
                   "in fp32), oneDNN's bf16 on AMX; bf16 = torch's bf16 throughout; fp32 = "
                   "every batch in fp32 (the weights also held in fp32)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant arithmetic: tokens and logprobs bit-identical alone or "
                   "in any batch, chunked or not, preempted, prefix-cached or not, prefilled here "
                   "or on a prefill node (both must set it); slower prefill")
    p.add_argument("--canary-rate", type=float, default=0.0, metavar="R",
                   help="recompute this fraction of completed greedy or seeded requests when the "
                   "node is idle and compare with what was served (bit for bit under "
                   "--deterministic); results in pdserve:canary_checks_total")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="shard the model over N processes (attention heads split, KV heads "
                   "split or replicated); N must divide the attention heads")


def add_node_args(p: argparse.ArgumentParser, role: str) -> None:
    """Flags of a node; `role` is prefill, decode or serve (which takes every flag)."""
    p.add_argument("--grpc-host", default=c.DEFAULT_HOST,
                   help="address the gRPC control plane binds (default: loopback)")
    p.add_argument("--transfer-host", default=c.DEFAULT_HOST,
                   help="address the KV transfer receiver binds (default: loopback)")
    p.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                   help="file holding the secret shared by the cluster's nodes (>= 16 bytes); "
                   "authenticates gRPC calls and KV links (default: $PDSERVE_CLUSTER_SECRET_FILE)")
    p.add_argument("--insecure", action="store_true",
                   help="allow gRPC or transfer on a non-loopback address without a secret")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve gRPC (and HTTP) over TLS with this certificate chain")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the key of --tls-cert")
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="decode: call prefill nodes over TLS, trusting this CA or certificate")
    grpc_flag = "--grpc-port" if role == "serve" else "--port"
    p.add_argument(grpc_flag, dest="grpc_port", type=int, default=0, help="gRPC port (0: free)")
    p.add_argument("--transfer-port", type=int, default=0, help="KV transfer port (0: free)")
    p.add_argument("--transfer-backend", default=c.DEFAULT_TRANSFER_BACKEND,
                   choices=["tcp", "nixl", "inprocess"],
                   help="how KV moves: tcp, or nixl (NIXL/UCX: RDMA where the fabric has it)")
    p.add_argument("--request-timeout", type=float, default=c.DEFAULT_REQUEST_TIMEOUT_S,
                   help="seconds a request may take from its arrival, queueing, prefill and "
                   "generation included (HTTP and gRPC; gRPC's timeout_s overrides it); past "
                   "it the request ends 504 naming its stage")
    p.add_argument("--advertise-host", default=None,
                   help="decode: the address prefill nodes reach this node's KV receiver at "
                   "(default: --transfer-host; set it when binding 0.0.0.0)")
    p.add_argument("--prefill", action="append", required=role == "decode", metavar="HOST:PORT",
                   help="decode: a prefill node's gRPC address (repeatable)")
    p.add_argument("--min-prefill-tokens", type=int, default=c.DEFAULT_MIN_PREFILL_TOKENS,
                   help="decode: prompts shorter than this are prefilled on decode itself")
    p.add_argument("--prefill-failure", default=c.DEFAULT_PREFILL_FAILURE,
                   choices=c.PREFILL_FAILURES,
                   help="decode: when a prefill node fails a request (dies, stops, cuts the "
                   "transfer, is overloaded), compute the prompt here (local) or fail it")
    p.add_argument("--prefill-placement", default=c.DEFAULT_PREFILL_PLACEMENT,
                   choices=c.PREFILL_PLACEMENTS,
                   help="decode: where prompts are prefilled: static (on a prefill node unless "
                   "shorter than --min-prefill-tokens, after what this node has cached) or "
                   "measured (wherever the first token comes sooner, from the times this node "
                   "measured of its recent prompts here and on prefill nodes)")
    p.add_argument("--probe-cap", type=float, default=c.DEFAULT_PROBE_CAP_S,
                   help="decode: cap in seconds on probing a prefill node")
    p.add_argument("--max-pending", type=int, default=c.DEFAULT_MAX_PENDING,
                   help="requests in the engine beyond which new ones are refused (HTTP 503)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="requests waiting to be scheduled beyond which new ones are refused")
    p.add_argument("--max-concurrent-rpcs", type=int, default=c.DEFAULT_MAX_CONCURRENT_RPCS,
                   help="generation calls (Prefill, Generate) served at once; more get "
                        "RESOURCE_EXHAUSTED (probes and stats still answer)")
    p.add_argument("--reader-idle-timeout", type=float, default=c.DEFAULT_READER_IDLE_S,
                   help="seconds a stream may go unread before its request is aborted")
    p.add_argument("--max-transfer-connections", type=int,
                   default=c.DEFAULT_MAX_TRANSFER_CONNECTIONS,
                   help="decode: inbound KV transfer connections served at once")
    p.add_argument("--kv-checksum", action="store_true",
                   help="prefill sends a checksum (xxh3-64) of each layer's KV with it, decode "
                   "verifies the bytes in its blocks before taking them; a mismatch fails that "
                   "request alone. Both sides must agree (the probe refuses a mismatch)")
    p.add_argument("--testing-corrupt-kv-frame", type=int, default=0,
                   help=argparse.SUPPRESS)  # fault injection for tests: that frame's bytes
    p.add_argument("--testing-transfer-delay-ms", type=float, default=0.0,
                   help=argparse.SUPPRESS)  # fault injection for tests: a slow network
    add_tracing_arg(p)
    if role == "serve":
        p.add_argument("--role", choices=c.ROLES, default=None,
                       help="run one node (default: a local prefill+decode pair)")
        p.add_argument("--port", dest="http_port", type=int, default=c.DEFAULT_HTTP_PORT,
                       help="HTTP port")
        p.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                       help="without --role: the prefill node's tensor-parallel size "
                       "(default: --tensor-parallel-size)")
        p.add_argument("--decode-tp", type=int, default=None, metavar="N",
                       help="without --role: the decode node's tensor-parallel size "
                       "(default: --tensor-parallel-size)")
        p.add_argument("--served-model-name", default=None,
                       help="model name clients send (default: derived from --model)")
        p.add_argument("--host", default=c.DEFAULT_HOST,
                       help="address the HTTP API binds (default: loopback)")
        add_api_key_args(p)
        p.add_argument("--router-key-file", default=None, metavar="PATH",
                       help="file holding the router's key (its --node-api-key-file): with it "
                       "only the router may read /kv_events and choose the prefill node "
                       "(default: $PDSERVE_ROUTER_KEY; none: any API key holder may)")
        p.add_argument("--api-key-metrics", action="store_true",
                       help="require the API key for /metrics too (/health stays open)")
        p.add_argument("--max-body-bytes", type=int, default=c.DEFAULT_MAX_BODY_BYTES,
                       help="larger HTTP request bodies get 413")
        p.add_argument("--trust-chat-special-tokens", action="store_true",
                       help="parse special-token strings inside chat content as control tokens "
                       "(for trusted clients; by default they are plain text)")


def add_api_key_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="file holding the key clients must send as 'Authorization: Bearer KEY' "
                   "(mode 600; default: $PDSERVE_API_KEY; none: the API is open, and only "
                   "on loopback unless --insecure)")
    p.add_argument("--api-key", default=None,
                   help="the key itself (visible to other users in `ps`: prefer --api-key-file "
                   "or $PDSERVE_API_KEY)")


def add_router_args(p: argparse.ArgumentParser, nodes: bool = True) -> None:
    """The router's flags; `nodes`: with its static --decode/--prefill lists."""
    if nodes:
        p.add_argument("--decode", action="append", required=True, metavar="URL",
                       help="a decode entrance's HTTP base URL (repeat for each)")
        p.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                       help="a prefill node's gRPC address, as the decodes' --prefill name it "
                       "(repeat; none: every prompt prefills on decode)")
    p.add_argument("--policy", default="cache_aware", choices=c.ROUTER_POLICIES)
    p.add_argument("--local-prefill-below", type=int, default=0, metavar="CHARS",
                   help="prompts shorter than this many characters prefill on decode")
    p.add_argument("--prefill-queue-limit", type=int, default=0, metavar="N",
                   help="when every prefill node has N requests in flight and the chosen "
                   "decode none, prefill on decode (0: never)")
    p.add_argument("--host", default=c.DEFAULT_HOST, help="address the router's HTTP binds")
    p.add_argument("--port", type=int, default=c.DEFAULT_ROUTER_PORT,
                   help="the router's HTTP port (0: free)")
    add_api_key_args(p)
    p.add_argument("--insecure", action="store_true",
                   help="allow the router on a non-loopback --host without an API key")
    p.add_argument("--max-body-bytes", type=int, default=c.DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 (the rest is never read)")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="serve HTTPS with this chain")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the key of --tls-cert")
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="trust this CA (or certificate) for decodes served over HTTPS")
    p.add_argument("--max-connections", type=int, default=c.DEFAULT_ROUTER_MAX_CONNECTIONS,
                   help="connections the router opens to decodes for requests (health probes "
                   "use their own)")
    p.add_argument("--request-timeout", type=float, default=c.DEFAULT_REQUEST_TIMEOUT_S,
                   help="seconds a routed request may take; past it the router ends it 504 "
                   "and closes its upstream (the decode aborts it)")
    p.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="the nodes' --model: cache_aware then follows the decodes' KV events "
                   "(their prefix caches, by block key) instead of only its own choices")
    p.add_argument("--block-size", type=int, default=16, help="the nodes' --block-size")
    p.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                   help="the nodes' cluster secret: their prefix-cache keys are keyed with it, "
                   "and the router follows their KV events by the same keys "
                   "(default: $PDSERVE_CLUSTER_SECRET_FILE)")
    p.add_argument("--node-api-key-file", default=None, metavar="PATH",
                   help="file holding the decodes' API key, for the router's own calls to them "
                   "(/metrics, /kv_events) and, when the router checks its own --api-key, for "
                   "the requests it forwards (default: $PDSERVE_NODE_API_KEY)")
    p.add_argument("--node-api-key", default=None,
                   help="the decodes' key itself (prefer --node-api-key-file)")
    add_tracing_arg(p)


def add_tracing_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export OpenTelemetry traces of every request over OTLP/HTTP to this "
                   "collector (a bare host:port gets /v1/traces); default: "
                   "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT, else off")


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--address", default=None,
                   help="an existing Ray cluster ('auto' or HOST:PORT, as `ray start` printed); "
                   "default: start a local one")
    p.add_argument("--node-ip", default=c.DEFAULT_HOST,
                   help="the address a local Ray cluster advertises (default: loopback)")
    p.add_argument("--node-args", default="", metavar="'FLAGS'",
                   help="flags given to every node, e.g. '--model DIR --dtype float32'")
    p.add_argument("--prefill-port-base", type=int, default=50051,
                   help="prefill node i serves gRPC on this port + i")
    p.add_argument("--decode-port-base", type=int, default=8001,
                   help="decode node i serves HTTP on this port + i")
    p.add_argument("--cpus-per-node", type=float, default=1.0)
    p.add_argument("--prefill-resource", default=None, metavar="NAME",
                   help="a custom Ray resource prefill nodes require (to place them)")
    p.add_argument("--decode-resource", default=None, metavar="NAME")


def build_parser(
    cmd_generate: Callable[[argparse.Namespace], int],
    cmd_node: Callable[[argparse.Namespace], int],
    cmd_router: Callable[[argparse.Namespace], int],
    cmd_cluster: Callable[[argparse.Namespace], int] = lambda args: 0,
    cmd_drain: Callable[[argparse.Namespace], int] = lambda args: 0,
    cmd_top: Callable[[argparse.Namespace], int] = lambda args: 0,
) -> argparse.ArgumentParser:
    from pdserve.bench.command import add_bench_args, run_bench_serve

    parser = argparse.ArgumentParser(prog="pdserve", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="json: one JSON object per line (access records carry request id, "
                        "status, tokens and timings as keys)")
    sub = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser("generate",
                         help="generate text for prompts on this machine, without a server")
    add_engine_args(gen)
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--no-chat", dest="chat", action="store_false",
                     help="send the raw prompt without the chat template")
    gen.set_defaults(func=cmd_generate)
    for role, text in (("serve", "serve the OpenAI API: a local prefill+decode pair, or --role"),
                       ("prefill", "run a prefill node that decode nodes call (gRPC only)"),
                       ("decode", "run a decode node in front of prefill nodes (gRPC only)")):
        node = sub.add_parser(role, help=text)
        add_engine_args(node)
        add_node_args(node, role)
        node.set_defaults(func=cmd_node)
    router = sub.add_parser("router", help="route OpenAI requests over several decode "
                            "entrances and prefill nodes (policies: round robin, least loaded, "
                            "cache aware)")
    add_router_args(router)
    router.set_defaults(func=cmd_router)
    cluster = sub.add_parser("cluster", help="run prefill and decode nodes as Ray actors "
                             "(placed, watched and restarted by Ray) behind the router")
    add_cluster_args(cluster)
    add_router_args(cluster, nodes=False)
    cluster.set_defaults(func=cmd_cluster)
    drain = sub.add_parser("drain", help="take a decode out of a router's rotation: its "
                           "streams go on from other decodes, then it can stop (--undo: back in)")
    drain.add_argument("--router", required=True, metavar="URL")
    drain.add_argument("--decode", required=True, metavar="URL",
                       help="the decode as the router names it (its --decode URL)")
    drain.add_argument("--timeout", type=float, default=c.DEFAULT_DRAIN_TIMEOUT_S,
                       help="seconds to wait for requests that cannot move (several choices, "
                       "not streamed) to finish there")
    drain.add_argument("--undo", action="store_true", help="put the decode back in rotation")
    drain.add_argument("--recompute", action="store_true",
                       help="move streams by computing them again on the other decodes, not "
                       "live with their KV (the default where the decode can pause them)")
    drain.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="file holding the router's --api-key (default: $PDSERVE_API_KEY)")
    drain.add_argument("--api-key", default=None, help="the router's key itself")
    drain.set_defaults(func=cmd_drain)

    top = sub.add_parser("top", help="the fleet behind a router in the terminal, refreshed: each "
                         "node's role, health, requests, KV use, prefix hits, KV GB/s, and the "
                         "router's audit of its prefix predictions")
    top.add_argument("--router", required=True, metavar="URL")
    top.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    top.add_argument("--once", action="store_true", help="print one screen and exit")
    top.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="file holding the decodes' key, for their /metrics when it needs one "
                     "(default: $PDSERVE_API_KEY)")
    top.add_argument("--api-key", default=None, help="the decodes' key itself")
    top.set_defaults(func=cmd_top)
    bench = sub.add_parser("bench",
                           help="load-test a running OpenAI-compatible server, report latencies")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server")
    add_bench_args(bench_serve)
    bench_serve.set_defaults(func=run_bench_serve)
    return parser
# fmt: on
