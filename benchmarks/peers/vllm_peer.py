#!/usr/bin/env python3
"""vLLM-CPU peer launcher for side-by-side comparisons (run with the vLLM venv's python).

  vllm_peer.py colocated --port P   one vLLM OpenAI server on 127.0.0.1:P, OpenMP on cores 0-1
  vllm_peer.py pd        --port P   prefill server (core 0, kv_producer) + decode server (core 1,
                                    kv_consumer), NixlConnector with kv_buffer_device=cpu, and an
                                    asyncio proxy on 127.0.0.1:P doing vLLM's two-step P/D flow

Defaults: bf16 (--dtype float32 for fp32), torch.compile (first start ~2 min, later ~1.5 min
with the compile cache; --enforce-eager ~30 s but slower decode), VLLM_CPU_KVCACHE_SPACE=1 GiB per
server, max-model-len 4096, max-num-seqs 16. pd also sets OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=0,
UCX_NET_DEVICES=lo, and loads two small import hooks (sitecustomize.py on PYTHONPATH, see
HOOKS_SRC) that fix what makes vLLM 0.32 P/D useless on 2 cores: NIXL's progress thread spinning
a whole core, and vLLM re-pinning the prefill worker onto the decode core. --nixl-progress spin
--vllm-kv-affinity gives the as-shipped behaviour (measured ~4.5x lower throughput). Extra vLLM
server arguments go after `--` (passed to every vLLM server).

Example: venv/bin/python vllm_peer.py pd --port 8400 --pid-file /tmp/pd.pid; then
kill -TERM $(cat /tmp/pd.pid). Prints one line
`READY <mode> http://127.0.0.1:P model=<name> startup_s=<s>` when it can serve, runs until
SIGINT/SIGTERM (or a child dies), then stops every child process group (TERM, then KILL) and
exits. Start-up is bounded by --ready-timeout. Only the stdlib and aiohttp are used.
"""

import argparse
import asyncio
import contextlib
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

try:
    import aiohttp
    from aiohttp import web
except ImportError:  # pragma: no cover
    sys.exit("aiohttp missing: run this with the vLLM venv's python (DIR/venv/bin/python)")

HOST = "127.0.0.1"
HERE_DEFAULT_MODEL = "/tmp/vllm-peer/smollm2-hf"
PROXY_PREFILL_PARAMS = {  # what vLLM's own toy proxy sends to the prefill instance
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
COMMON_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
    "VLLM_HOST_IP": HOST,
    "PYTHONUNBUFFERED": "1",
}
# OpenMP busy-waiting on 2 shared cores makes P/D latency explode (0.8-17 s instead of ~1 s)
PASSIVE_OMP = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}


# sitecustomize.py put on the PYTHONPATH of every vLLM process of a `pd` peer (the API server,
# the spawned EngineCore and Worker processes all run it at start). It patches two things at
# import time:
#  nixl_progress_poll: NIXL's UCX progress thread loops on poll(efds, timeout=pthrDelay ms) and
#     the python API hard-codes pthrDelay=0, so it spins ~100% of a core (mostly in the kernel)
#     even when idle; on a 2-core box it steals the compute core of its own server. The hook sets
#     pthrDelay to VLLM_PEER_NIXL_PTHR_DELAY_US (default 1000 us -> poll timeout 1 ms): the thread
#     sleeps until UCX signals an event. (no_nixl_progress_thread removes the thread instead: idle
#     CPU is fine but KV pulls then crawl (~1 s for 14 MB) because the prefill side only
#     progresses UCX between its steps.)
#  keep_omp_affinity: vLLM's NIXL worker (nixl/base_worker.py) calls os.sched_setaffinity(0,
#     [last core of each NUMA node]) on the worker's main thread, which on CPU is also the OpenMP
#     master thread: the prefill server bound to core 0 silently ends up computing on core 1,
#     next to the decode server.
HOOKS_SRC = r"""
import os, sys
_H = set(filter(None, os.environ.get("VLLM_PEER_HOOKS", "").split(",")))
_T = {}
if "no_nixl_progress_thread" in _H:
    def _nixl(mod):
        cfg = getattr(mod, "nixl_agent_config", None)
        if cfg is None or getattr(cfg, "_vllm_peer", False):
            return
        orig = cfg.__init__
        def __init__(self, *a, **kw):
            orig(self, *a, **kw)
            self.enable_pthread = False
        cfg.__init__ = __init__
        cfg._vllm_peer = True
        print("[vllm_peer hook] NIXL progress thread disabled (pid %d)" % os.getpid(),
              file=sys.stderr, flush=True)
    _T["nixl_cu12._api"] = _nixl
    _T["nixl_cu13._api"] = _nixl
if "nixl_progress_poll" in _H:
    def _nixl_poll(mod):
        real = getattr(mod, "nixlBind", None)
        if real is None or getattr(real, "_vllm_peer", False):
            return
        delay = int(os.environ.get("VLLM_PEER_NIXL_PTHR_DELAY_US", "1000"))
        class _BindProxy:
            _vllm_peer = True
            def __getattr__(self, n):
                return getattr(real, n)
            def nixlAgent(self, name, cfg, *a, **kw):
                cfg.pthrDelay = max(int(cfg.pthrDelay), delay)
                print("[vllm_peer hook] NIXL progress thread pthrDelay=%d us (pid %d)"
                      % (cfg.pthrDelay, os.getpid()), file=sys.stderr, flush=True)
                return real.nixlAgent(name, cfg, *a, **kw)
        mod.nixlBind = _BindProxy()
    _T["nixl_cu12._api"] = _nixl_poll
    _T["nixl_cu13._api"] = _nixl_poll
if "keep_omp_affinity" in _H:
    def _bw(mod):
        import os as _os
        class _OsProxy:
            def __getattr__(self, n):
                return getattr(_os, n)
            @staticmethod
            def sched_setaffinity(pid, cpus):
                print("[vllm_peer hook] ignored sched_setaffinity(%s, %s) in nixl base_worker; "
                      "keeping %s" % (pid, sorted(cpus), sorted(_os.sched_getaffinity(0))),
                      file=sys.stderr, flush=True)
        mod.os = _OsProxy()
    _T["vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"] = _bw
if _T:
    import importlib.abc
    class _PeerHookFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in _T:
                return None
            for f in sys.meta_path:
                if f is self or not hasattr(f, "find_spec"):
                    continue
                spec = f.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
            orig = spec.loader.exec_module
            def exec_module(module, _orig=orig, _fix=_T[name]):
                _orig(module)
                _fix(module)
            spec.loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, _PeerHookFinder())
"""


def write_hooks(log_dir):
    d = os.path.join(log_dir, "pyhooks")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "sitecustomize.py"), "w") as f:
        f.write(HOOKS_SRC)
    return d


def log(msg):
    print(f"[vllm_peer {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def port_free(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
            return True
        except OSError:
            return False


class Child:
    """A vLLM server in its own session / process group (pgid == pid)."""

    def __init__(self, name, port, cmd, env, logpath):
        self.name, self.port, self.cmd, self.logpath = name, port, cmd, logpath
        self.logf = open(logpath, "ab")  # noqa: SIM115 (closed by stop_children)
        self.logf.write(f"\n=== {time.ctime()} {' '.join(cmd)}\n".encode())
        self.logf.flush()
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=self.logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.pgid = self.proc.pid
        log(f"started {name}: pid/pgid {self.pgid} port {port} log {logpath}")

    def alive(self):
        return self.proc.poll() is None

    def group_alive(self):
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def signal_group(self, sig):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, sig)

    def tail(self, n=25):
        try:
            with open(self.logpath, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - 6000))
                return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def stop_children(children, timeout):
    live = [c for c in children if c.group_alive()]
    for c in live:
        log(f"stopping {c.name} (pgid {c.pgid}) with SIGTERM")
        c.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(c.group_alive() for c in live):
        for c in live:
            c.proc.poll()  # reap the leader
        time.sleep(0.2)
    for c in live:
        if c.group_alive():
            log(f"{c.name} (pgid {c.pgid}) still alive after {timeout}s: SIGKILL")
            c.signal_group(signal.SIGKILL)
    for c in children:
        try:
            c.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log(f"WARNING: {c.name} pid {c.pgid} did not exit")
        c.logf.close()


def vllm_cmd(args, port, kv_cfg=None):
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        args.model,
        "--host",
        HOST,
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
    ]
    if args.served_model_name:
        cmd += ["--served-model-name", args.served_model_name]
    if args.enforce_eager:
        cmd += ["--enforce-eager"]
    if kv_cfg is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_cfg)]
    return cmd + args.vllm_args


def child_env(args, extra):
    env = dict(os.environ)
    env.update(COMMON_ENV)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gb)
    env.update(extra)
    for kv in args.env:
        k, _, v = kv.partition("=")
        env[k] = v
    return env


async def wait_ready(children, deadline, stop):
    """Poll /health of every child until 200; fail if a child exits, on timeout or on a signal."""
    pending = {c.name: c for c in children}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as s:
        while pending:
            for name, c in list(pending.items()):
                if not c.alive():
                    raise RuntimeError(
                        f"{name} exited with rc {c.proc.returncode} during start-up:\n{c.tail()}"
                    )
                try:
                    async with s.get(f"http://{HOST}:{c.port}/health") as r:
                        if r.status == 200:
                            log(f"{name} healthy after {time.monotonic() - T_START:.1f}s")
                            del pending[name]
                except (TimeoutError, aiohttp.ClientError, OSError):
                    pass
            if not pending:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    "not ready within --ready-timeout: "
                    + ", ".join(pending)
                    + "\n"
                    + "\n".join(c.tail(10) for c in pending.values())
                )
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
                raise KeyboardInterrupt("signal during start-up")
            except TimeoutError:
                pass


async def model_name(port):
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.get(f"http://{HOST}:{port}/v1/models") as r,
    ):
        return (await r.json())["data"][0]["id"]


# ------------------------------------------------------------------------------------------ proxy
class PDProxy:
    def __init__(self, prefill_url, decode_url, request_timeout):
        self.p, self.d = prefill_url, decode_url
        self.timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=10)
        self.session = None
        self.stats = {"requests": 0, "errors": 0, "no_kv_params": 0}

    async def start(self, app):
        self.session = aiohttp.ClientSession(
            timeout=self.timeout, connector=aiohttp.TCPConnector(limit=0, force_close=False)
        )

    async def close(self, app):
        if self.session:
            await self.session.close()

    def app(self):
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.handle_generate)
        app.router.add_post("/v1/chat/completions", self.handle_generate)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.close)
        return app

    async def handle_models(self, request):
        async with self.session.get(self.d + "/v1/models") as r:
            return web.Response(
                body=await r.read(), status=r.status, content_type="application/json"
            )

    async def handle_health(self, request):
        for u in (self.p, self.d):
            try:
                async with self.session.get(u + "/health") as r:
                    if r.status != 200:
                        return web.Response(status=503, text=f"{u} {r.status}")
            except (TimeoutError, aiohttp.ClientError) as e:
                return web.Response(status=503, text=f"{u} {e!r}")
        return web.Response(text="ok")

    async def handle_generate(self, request):
        path = request.path
        self.stats["requests"] += 1
        try:
            req = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": {"message": "invalid JSON body"}}, status=400)
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        # 1. prefill: same request, 1 token, no streaming, ask P to keep the KV for a remote decode
        p_req = copy.deepcopy(req)
        p_req["stream"] = False
        p_req.pop("stream_options", None)
        p_req["max_tokens"] = 1
        if "max_completion_tokens" in p_req:
            p_req["max_completion_tokens"] = 1
        if p_req.get("min_tokens"):
            p_req["min_tokens"] = 0
        p_req["kv_transfer_params"] = dict(PROXY_PREFILL_PARAMS)
        try:
            async with self.session.post(
                self.p + path, json=p_req, headers={"X-Request-Id": "p-" + rid}
            ) as r:
                p_body = await r.read()
                if r.status != 200:
                    self.stats["errors"] += 1
                    return web.Response(
                        body=p_body, status=r.status, content_type="application/json"
                    )
            ktp = json.loads(p_body).get("kv_transfer_params")
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as e:
            self.stats["errors"] += 1
            return web.json_response({"error": {"message": f"prefill failed: {e!r}"}}, status=502)
        # 2. decode: the original request plus P's kv_transfer_params (D pulls the KV blocks
        # via NIXL)
        d_req = req
        if ktp:
            d_req["kv_transfer_params"] = ktp
        else:
            self.stats["no_kv_params"] += 1  # D recomputes the prompt; answer still correct
        stream = bool(req.get("stream"))
        resp = None
        try:
            async with self.session.post(
                self.d + path, json=d_req, headers={"X-Request-Id": "d-" + rid}
            ) as r:
                if not stream or r.status != 200:
                    body = await r.read()
                    if r.status != 200:
                        self.stats["errors"] += 1
                    return web.Response(
                        body=body,
                        status=r.status,
                        content_type=r.content_type or "application/json",
                    )
                resp = web.StreamResponse(
                    status=200,
                    headers={
                        "Content-Type": r.headers.get("Content-Type", "text/event-stream"),
                        "Cache-Control": "no-cache",
                    },
                )
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (TimeoutError, aiohttp.ClientError) as e:
            self.stats["errors"] += 1
            if resp is not None and resp.prepared:
                raise  # headers already sent: drop the connection
            return web.json_response({"error": {"message": f"decode failed: {e!r}"}}, status=502)


# ------------------------------------------------------------------------------------------ main
async def amain(args):
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    os.makedirs(args.log_dir, exist_ok=True)
    tag = f"{args.mode}-{args.port}"
    children = []
    runner = None
    rc = 0
    try:
        if args.mode == "colocated":
            ports = [args.port]
        else:
            pp, dp = args.prefill_port or args.port + 1, args.decode_port or args.port + 2
            ports = [args.port, pp, dp] + list(args.side_ports)
        busy = [p for p in ports if not port_free(p)]
        if busy:
            raise RuntimeError(f"ports already in use on {HOST}: {busy}")
        if args.mode == "colocated":
            env = child_env(args, {"VLLM_CPU_OMP_THREADS_BIND": args.colocated_cores})
            if args.passive_omp:
                env.update(PASSIVE_OMP)
            children.append(
                Child(
                    "server",
                    args.port,
                    vllm_cmd(args, args.port),
                    env,
                    os.path.join(args.log_dir, f"{tag}-server.log"),
                )
            )
        else:
            hooks = [
                h
                for h, on in (
                    ("nixl_progress_poll", args.nixl_progress == "poll"),
                    ("no_nixl_progress_thread", args.nixl_progress == "off"),
                    ("keep_omp_affinity", not args.vllm_kv_affinity),
                )
                if on
            ]
            hook_env = {}
            if hooks:
                hook_env = {
                    "VLLM_PEER_HOOKS": ",".join(hooks),
                    "PYTHONPATH": write_hooks(args.log_dir)
                    + (
                        os.pathsep + os.environ["PYTHONPATH"]
                        if os.environ.get("PYTHONPATH")
                        else ""
                    ),
                }
                log(f"pd hooks: {hooks}")
            kvp = {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_producer",
                "kv_buffer_device": "cpu",
            }
            kvd = {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_consumer",
                "kv_buffer_device": "cpu",
            }
            for name, port, kv, core, side in (
                ("prefill", pp, kvp, args.prefill_core, args.side_ports[0]),
                ("decode", dp, kvd, args.decode_core, args.side_ports[1]),
            ):
                env = child_env(
                    args,
                    {
                        **PASSIVE_OMP,
                        **hook_env,
                        "UCX_NET_DEVICES": args.ucx_net_devices,
                        "VLLM_CPU_OMP_THREADS_BIND": core,
                        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
                    },
                )
                cmd = vllm_cmd(args, port, kv)
                if args.taskset:
                    cmd = ["taskset", "-c", core] + cmd
                children.append(
                    Child(name, port, cmd, env, os.path.join(args.log_dir, f"{tag}-{name}.log"))
                )
        await wait_ready(children, T_START + args.ready_timeout, stop)
        name = await model_name(children[-1].port)
        if args.mode == "pd":
            proxy = PDProxy(f"http://{HOST}:{pp}", f"http://{HOST}:{dp}", args.request_timeout)
            runner = web.AppRunner(proxy.app(), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, HOST, args.port).start()
        print(
            f"READY {args.mode} http://{HOST}:{args.port} model={name} "
            f"startup_s={time.monotonic() - T_START:.1f}",
            flush=True,
        )
        while not stop.is_set():  # run until a signal, or a child dies
            dead = [c for c in children if not c.alive()]
            if dead:
                c = dead[0]
                log(f"ERROR: {c.name} exited with rc {c.proc.returncode}:\n{c.tail()}")
                rc = 1
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)
        if stop.is_set():
            log("signal received, shutting down")
        if args.mode == "pd":
            log(f"proxy stats: {proxy.stats}")
    except KeyboardInterrupt as e:
        log(f"interrupted: {e}")
        rc = 130
    except (RuntimeError, TimeoutError) as e:
        log(f"ERROR: {e}")
        rc = 1
    finally:
        if runner is not None:
            try:
                await asyncio.wait_for(runner.cleanup(), timeout=10)
            except Exception as e:  # noqa: BLE001
                log(f"proxy cleanup: {e!r}")
        await loop.run_in_executor(None, stop_children, children, args.stop_timeout)
        log(f"all children stopped; exit {rc}")
    return rc


def parse(argv):
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("mode", choices=["colocated", "pd"])
    ap.add_argument("--port", type=int, required=True, help="public OpenAI port on 127.0.0.1")
    ap.add_argument("--model", default=os.environ.get("VLLM_PEER_MODEL", HERE_DEFAULT_MODEL))
    ap.add_argument(
        "--served-model-name", default=None, help="default: the model path (vLLM default)"
    )
    ap.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds to wait for /health"
    )
    ap.add_argument(
        "--stop-timeout", type=float, default=20.0, help="seconds between SIGTERM and SIGKILL"
    )
    ap.add_argument("--request-timeout", type=float, default=600.0, help="proxy per-request bound")
    ap.add_argument("--log-dir", default="/tmp/vllm-peer/logs")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--kv-cache-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per server")
    ap.add_argument(
        "--enforce-eager",
        action="store_true",
        help="skip torch.compile: start-up ~30-45 s instead of ~2 min, but ~1.5x slower decode "
        "and slightly different bf16 numerics (greedy answers can differ from compiled mode)",
    )
    ap.add_argument("--colocated-cores", default="0-1")
    ap.add_argument(
        "--passive-omp", action="store_true", help="colocated: also set OMP_WAIT_POLICY=PASSIVE"
    )
    ap.add_argument("--prefill-core", default="0")
    ap.add_argument("--decode-core", default="1")
    ap.add_argument(
        "--taskset",
        action="store_true",
        help="pd: also wrap each server in taskset -c CORE (default: only OpenMP threads bound; "
        "untested)",
    )
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--prefill-port", type=int, default=0, help="default PORT+1")
    ap.add_argument("--decode-port", type=int, default=0, help="default PORT+2")
    ap.add_argument(
        "--side-ports",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[5600, 5601],
        help="NIXL side-channel ports of prefill,decode",
    )
    ap.add_argument(
        "--env", action="append", default=[], help="K=V added to every server's environment"
    )
    ap.add_argument(
        "--ucx-net-devices",
        default="lo",
        help="pd: UCX_NET_DEVICES for NIXL (default lo: UCX's TCP transport, which NIXL needs for "
        "its peer-failure mode, stays on loopback; bulk KV moves over shared memory/CMA)",
    )
    ap.add_argument(
        "--nixl-progress",
        choices=["poll", "spin", "off"],
        default="poll",
        help="pd: NIXL UCX progress thread: poll (default, hook sets pthrDelay 1 ms), spin (as "
        "shipped: pthrDelay 0, burns a core per server), off (no thread: slow KV pulls)",
    )
    ap.add_argument(
        "--vllm-kv-affinity",
        action="store_true",
        help="pd: let vLLM's NIXL worker re-pin its main thread to the last core (default: "
        "blocked by a hook so prefill really computes on --prefill-core)",
    )
    ap.add_argument("--pid-file", default=None, help="write this launcher's PID here")
    args = ap.parse_args(argv)
    args.vllm_args = extra
    if args.pid_file:
        with open(args.pid_file, "w") as f:
            f.write(f"{os.getpid()}\n")
    if not os.path.isdir(args.model):
        ap.error(f"model dir {args.model} not found (run vllm_peer_setup.sh first)")
    return args


if __name__ == "__main__":
    T_START = time.monotonic()
    sys.exit(asyncio.run(amain(parse(sys.argv[1:]))))
