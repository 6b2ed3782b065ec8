"""The HTTP server's own limits, over real sockets (the server the nodes and the router run,
with a small app): a request head trickled in a byte at a time (slowloris) is cut off at the
receipt deadline however often bytes come; a body trickled in gets 408 at the body deadline;
beyond the concurrency limit a request gets 503; the access log escapes control characters,
so a percent-encoded newline in a path cannot forge a log line."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from fastapi import FastAPI, Request

from pdserve.api.access import AccessLog
from pdserve.api.guard import Guard
from pdserve.serve.http import HttpLimits, HttpServer


class Served:
    """An app under HttpServer on its own event loop thread."""

    def __init__(self, **limits: float) -> None:
        app = FastAPI()
        self.release = threading.Event()

        @app.post("/echo")
        async def echo(request: Request) -> dict[str, int]:
            return {"bytes": len(await request.body())}

        @app.get("/wait")
        async def wait() -> dict[str, bool]:
            await asyncio.to_thread(self.release.wait, 10)
            return {"ok": True}

        app.add_middleware(
            Guard, api_key=None, open_paths=(), max_body_bytes=1 << 20, body_timeout_s=1.0
        )
        app.add_middleware(AccessLog)
        self.loop = asyncio.new_event_loop()
        self.server = HttpServer(app, "127.0.0.1", 0, limits=HttpLimits(**limits))  # type: ignore[arg-type]
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        self.port = int(self.server.address.rsplit(":", 1)[1])

    def stop(self) -> None:
        self.release.set()
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served(receipt_timeout_s=1.0, max_concurrency=3)
    yield s
    s.stop()


def drip(port: int, data: bytes, every_s: float = 0.2) -> tuple[int, bytes]:
    """Send `data` a byte at a time; (bytes sent before the server answered or closed, what
    it answered)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.setblocking(False)
        for i, byte in enumerate(data):
            try:
                answer = s.recv(4096)
                return i, answer
            except BlockingIOError:
                pass
            except ConnectionResetError:  # closed, and a byte we sent after that was refused
                return i, b""
            try:
                s.send(bytes([byte]))
            except OSError:
                return i, b""
            time.sleep(every_s)
        s.settimeout(5)
        return len(data), s.recv(4096)


def test_a_head_trickled_in_is_cut_off_at_the_receipt_deadline(served: Served) -> None:
    head = b"GET /wait HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 60 + b"\r\n\r\n"
    sent, answer = drip(served.port, head)
    assert answer == b"" and sent < 20  # closed after ~1 s of the ~20 s the head would take


def test_a_body_trickled_in_gets_408(served: Served) -> None:
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as s:
        s.sendall(head)
        _, answer = drip_on(s, b"{" * 100)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]


def drip_on(s: socket.socket, data: bytes) -> tuple[int, bytes]:
    s.setblocking(False)
    for i, byte in enumerate(data):
        try:
            return i, s.recv(4096)
        except BlockingIOError:
            pass
        s.send(bytes([byte]))
        time.sleep(0.1)
    return len(data), b""


def test_beyond_the_concurrency_limit_requests_get_503(served: Served) -> None:
    def get() -> bytes:
        with socket.create_connection(("127.0.0.1", served.port), timeout=15) as s:
            s.sendall(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
            return s.recv(4096)

    results: list[bytes] = []
    threads = [threading.Thread(target=lambda: results.append(get())) for _ in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.3)  # each one in before the next
    threads[-1].join(10)
    assert results and results[0].startswith(b"HTTP/1.1 503"), results
    served.release.set()
    for t in threads:
        t.join(10)
    assert sum(r.startswith(b"HTTP/1.1 200") for r in results) == 2


def test_the_access_log_escapes_control_characters(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="pdserve.access"):
        with socket.create_connection(("127.0.0.1", served.port), timeout=5) as s:
            s.sendall(b"GET /x%0Aforged%1b[31m HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            while s.recv(4096):
                pass
        deadline = time.monotonic() + 5
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.05)
    (record,) = [r for r in caplog.records if r.name == "pdserve.access"]
    line = record.getMessage()
    assert "\n" not in line and "\x1b" not in line
    assert "/x\\x0aforged\\x1b[31m" in line
