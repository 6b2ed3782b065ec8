"""`pdserve router` as a front door, with real processes on loopback (2 colocated decodes with a
tiny random model behind a router that checks an API key): a request without the key is
refused 401 before its body is read (a 1 GB body declared, 1 MiB of it sent); a request the
decode refuses leaves no trace in the router's counters; 150 concurrent streams through the
router leave every decode healthy and a new request succeeds; a non-streaming client that
goes away aborts its request on the decode, and so do streaming ones; a router with a short
`--request-timeout` ends a request 504 (or its stream with an error event) and the decode
stops computing it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cli.configs import cluster_config, http_config, router_config
from pdserve.cli.flags import build_parser
from pdserve.config import ConfigError
from tests.disagg.cluster import free_port
from tests.helpers import logs_kept_on_failure, make_tiny_model
from tests.router.test_router_e2e import Proc

pytestmark = pytest.mark.slow

MODEL = "tiny"
KEY = "router-front-door-key"
STREAMS = 150
LONG = 60_000  # output tokens no request here reaches before it is cut off


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                total += s.value
    return total


class Fleet:
    def __init__(self, model: Path, key_file: Path) -> None:
        self.procs: list[Proc] = []
        self.decodes = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        for url in self.decodes:
            args = ["serve", "--role", "both", "--model", str(model), "--dtype", "float32"]
            args += ["--threads", "1", "--port", url.rsplit(":", 1)[1], "--grpc-port", "0"]
            args += ["--served-model-name", MODEL, "--max-num-seqs", "256"]
            args += ["--max-model-len", str(LONG + 100), "--kv-cache-memory", "256"]
            self.procs.append(Proc(args, "decode"))
        for p in self.procs:
            p.wait_for("ready")
        self.key_file = key_file
        self.router = self.start_router()

    def start_router(self, *extra: str) -> str:
        url = f"http://127.0.0.1:{free_port()}"
        args = ["router", *[a for d in self.decodes for a in ("--decode", d)]]
        args += ["--policy", "round_robin", "--port", url.rsplit(":", 1)[1]]
        args += ["--api-key-file", str(self.key_file), *extra]
        self.procs.append(Proc(args, "router"))
        self.procs[-1].wait_for("router ready")
        return url

    def in_engine(self) -> float:
        """Requests running or waiting on the decodes."""
        return sum(
            metric(d, name)
            for d in self.decodes
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
        )

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.signal(15)
        for p in self.procs:
            p.wait_stopped()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("front-door")
    model = make_tiny_model(root / "tiny", max_position_embeddings=LONG + 100)
    key_file = root / "router.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    f = Fleet(model, key_file)
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture
def logs(fleet: Fleet, request: pytest.FixtureRequest) -> Iterator[None]:
    with logs_kept_on_failure(request, lambda: [p.log for p in fleet.procs]):
        yield


AUTH = {"authorization": f"Bearer {KEY}"}


def body(max_tokens: int, stream: bool = False) -> dict[str, object]:
    return {
        "model": MODEL,
        "prompt": [5, 6, 7, 8],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def status_after_sending(url: str, head: str, sent: int) -> tuple[int, int]:
    """(the HTTP status, the body bytes sent before it came): the head, then up to `sent`
    bytes of body, in chunks, reading the answer as soon as there is one."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head.encode())
        chunk, pushed = b"x" * 65536, 0
        s.setblocking(False)
        answer = b""
        deadline = time.monotonic() + 10
        while b"\r\n" not in answer and time.monotonic() < deadline:
            if pushed < sent:
                try:
                    pushed += s.send(chunk)
                except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                    time.sleep(0.01)
            else:
                time.sleep(0.01)
            with contextlib.suppress(BlockingIOError):
                answer += s.recv(4096)
        return int(answer.split(b" ", 2)[1]), pushed


def test_an_open_bind_without_a_key_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parse = build_parser(lambda a: 0, lambda a: 0, lambda a: 0).parse_args
    with pytest.raises(ConfigError, match="--api-key-file"):
        router_config(parse(["router", "--decode", "http://d:1", "--host", "0.0.0.0"]))
    assert (
        router_config(
            parse(["router", "--decode", "http://d:1", "--host", "0.0.0.0", "--insecure"])
        ).api_key
        is None
    )
    with pytest.raises(ConfigError, match="--api-key-file"):  # a node's HTTP API alike
        http_config(parse(["serve", "--host", "0.0.0.0"]))
    assert http_config(parse(["serve", "--host", "0.0.0.0", "--insecure"])).api_key is None
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(ConfigError, match="RAY_AUTH_MODE"):  # a local Ray's ports alike
        cluster_config(parse(["cluster", "--node-ip", "10.0.0.5"]))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert cluster_config(parse(["cluster", "--node-ip", "10.0.0.5"])).node_ip == "10.0.0.5"
    key = tmp_path / "key"
    key.write_text("k" * 20)
    key.chmod(0o644)  # others may read it: refused, naming the mode
    with pytest.raises(ConfigError, match="mode 644"):
        router_config(parse(["router", "--decode", "http://d:1", "--api-key-file", str(key)]))


def test_no_key_is_refused_before_the_body_and_refusals_leave_no_trace(
    fleet: Fleet, logs: None
) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        "Content-Length: 1073741824\r\n\r\n"
    )
    status, pushed = status_after_sending(fleet.router, head, 1 << 20)
    assert status == 401
    assert pushed <= 1 << 20  # answered with at most 1 MiB of the 1 GiB sent
    status, _ = status_after_sending(
        fleet.router, head.replace("Host", f"Authorization: Bearer {KEY}\r\nHost"), 1 << 20
    )
    assert status == 413  # with the key: beyond --max-body-bytes, still unread
    # A request the decode refuses (an unknown model): answered, and not counted anywhere.
    r = httpx.post(
        f"{fleet.router}/v1/completions", json={**body(4), "model": "other"}, headers=AUTH
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found", r.text
    assert metric(fleet.router, "pdserve:router_requests_total") == 0
    r = httpx.post(f"{fleet.router}/v1/completions", json=body(4), headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert metric(fleet.router, "pdserve:router_requests_total") == 1


def test_150_streams_leave_every_decode_healthy_and_clients_gone_are_aborted(
    fleet: Fleet, logs: None
) -> None:
    async def scenario() -> None:
        limits = httpx.Limits(max_connections=STREAMS + 10)
        async with httpx.AsyncClient(timeout=60, limits=limits, headers=AUTH) as client:
            first = asyncio.Queue[int]()

            async def stream() -> None:
                async with client.stream(
                    "POST", f"{fleet.router}/v1/completions", json=body(LONG, stream=True)
                ) as r:
                    assert r.status_code == 200
                    async for _ in r.aiter_raw():
                        first.put_nowait(1)
                        await asyncio.sleep(3600)  # held open, unread, until cancelled

            tasks = [asyncio.ensure_future(stream()) for _ in range(STREAMS)]
            for _ in range(STREAMS):
                await asyncio.wait_for(first.get(), 120)
            assert await asyncio.to_thread(fleet.in_engine) == STREAMS
            # Several poll periods (0.5 s) and probe timeouts (1 s): every decode stays in.
            until = time.monotonic() + 3
            while time.monotonic() < until:
                h = (await client.get(f"{fleet.router}/health")).json()
                assert h["decodes"] == fleet.decodes, h
                await asyncio.sleep(0.2)
            r = await client.post(f"{fleet.router}/v1/completions", json=body(4))
            assert r.status_code == 200, r.text
            # A non-streaming client that gives up: the decode stops computing its request.
            with pytest.raises(httpx.ReadTimeout):
                await client.post(f"{fleet.router}/v1/completions", json=body(LONG), timeout=2)
            await wait_for_in_engine(STREAMS)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await wait_for_in_engine(0)  # and the streams' clients gone: all aborted

    async def wait_for_in_engine(n: int) -> None:
        deadline = time.monotonic() + 15
        while (left := await asyncio.to_thread(fleet.in_engine)) != n:
            assert time.monotonic() < deadline, f"{left} requests on the decodes, not {n}"
            await asyncio.sleep(0.2)

    asyncio.run(scenario())


def test_a_routed_request_past_the_routers_deadline_ends_and_is_aborted(
    fleet: Fleet, logs: None
) -> None:
    router = fleet.start_router("--request-timeout", "1.5")
    r = httpx.post(f"{router}/v1/completions", json=body(LONG), headers=AUTH, timeout=30)
    assert r.status_code == 504, r.text
    assert "deadline" in r.json()["error"]["message"]
    with httpx.stream(
        "POST", f"{router}/v1/completions", json=body(LONG, True), headers=AUTH, timeout=30
    ) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert "deadline" in json.loads(events[-1][6:])["error"]["message"]
    deadline = time.monotonic() + 15
    while fleet.in_engine() != 0:
        assert time.monotonic() < deadline, "the decode kept computing a request past its end"
        time.sleep(0.2)
