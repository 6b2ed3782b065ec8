"""The local cluster's supervisor (serve/launcher.py) asks each node's /health while they
start: a port that answers with something other than HTTP counts as not healthy yet, as a port
nothing answers on does, instead of ending the supervisor with an exception (seen in CI: a port
picked free for a node's HTTP server was answering `PDKV1`, a KV receiver's greeting). The
ports it picks for its nodes lie below the kernel's ephemeral range, so that no listener bound to
port 0 can be handed one before the node binds it."""

from __future__ import annotations

import random
import socket
import threading

import pytest

from pdserve.serve.launcher import LOWEST_PICK, _ephemeral_low, free_port, health_status


def test_a_port_that_does_not_speak_http_is_not_healthy() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(b"PDKV1\x00\x00\x00\x10not http at all\r\n\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        assert health_status(f"http://127.0.0.1:{port}/health") is None
    finally:
        thread.join(5)
        server.close()


def test_a_closed_port_is_not_healthy() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    assert health_status(f"http://127.0.0.1:{port}/health") is None


def test_ports_picked_for_nodes_are_outside_the_kernels_ephemeral_range() -> None:
    """No listener bound to port 0 (ours, UCX's, another test's) can be handed a port the
    launcher picked for a node before the node binds it; each pick is free to bind."""
    low = _ephemeral_low()
    if low is None or low - LOWEST_PICK < 1000:
        pytest.skip(f"the kernel's ephemeral range starts at {low}: no room below it")
    for seed in range(20):
        port = free_port("127.0.0.1", random.Random(seed))
        assert LOWEST_PICK <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_not_picked() -> None:
    low = _ephemeral_low()
    if low is None or low - LOWEST_PICK < 1000:
        pytest.skip(f"the kernel's ephemeral range starts at {low}: no room below it")
    first = free_port("127.0.0.1", random.Random(7))
    with socket.create_server(("127.0.0.1", first)):
        assert free_port("127.0.0.1", random.Random(7)) != first
