"""The transfer port against peers without the secret that try to use up what it has: a
handshake dripped a byte at a time ends at its total deadline, not at a per-read one; one
address cannot hold every connection slot with handshakes it never finishes (a peer from
another address still links); an accept loop that runs out of descriptors (EMFILE) backs off
and serves again once they free up, instead of ending for good."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from pdserve.disagg.transport.handshake import MAGIC, NONCE_BYTES, open_handshake
from pdserve.disagg.transport.tcp_receiver import (
    MAX_HANDSHAKES_PER_ADDRESS,
    ReceiverLimits,
    TcpReceiverServer,
)


def refuse_frames(*args: object) -> None:
    raise AssertionError("no frame is sent in these tests")


@pytest.fixture
def server() -> Iterator[TcpReceiverServer]:
    s = TcpReceiverServer(
        refuse_frames, limits=ReceiverLimits(max_connections=16, handshake_timeout_s=1.0)
    )
    yield s
    s.stop()


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_a_handshake_dripped_a_byte_at_a_time_ends_at_its_total_deadline(
    server: TcpReceiverServer,
) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        hello = b""
        while len(hello) < len(MAGIC) + NONCE_BYTES:
            hello += sock.recv(64)
        sock.setblocking(False)
        dripped = 0
        while not closed(sock):
            # Each byte well within any per-read timeout; the whole answer (48 bytes) would
            # take ~10 s.
            assert dripped < 30, "the receiver kept waiting for a handshake dripped bytewise"
            try:
                sock.send(b"\0")
            except OSError:
                break
            dripped += 1
            time.sleep(0.2)
    assert server.handshakes_failed == 1


def test_one_address_cannot_hold_every_connection_slot(server: TcpReceiverServer) -> None:
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(20)]
    try:
        deadline = time.monotonic() + 5
        while server.refused_per_address < 20 - MAX_HANDSHAKES_PER_ADDRESS:
            assert time.monotonic() < deadline, server.stats()
            time.sleep(0.05)
        # Another address (127.0.0.2 is loopback too) still gets a slot and links.
        member = socket.create_connection(
            ("127.0.0.1", server.port), timeout=5, source_address=("127.0.0.2", 0)
        )
        with member:
            open_handshake(member, None)
    finally:
        for s in idle:
            s.close()


# The script uses up its descriptors, then, with the test's two connections waiting, holds them
# until the accept loop has counted an EMFILE (within a deadline) and frees them. Two
# connections, held open, because a blocked accept() takes its descriptor before it waits: the
# loop may hold one from before the fill and accept the first connection with it; the second
# then meets EMFILE either way. (With one connection the test failed once in CI, "0 >= 1": that
# connection, accepted with the held descriptor, was served and closed before the loop called
# accept() again, which then found its descriptor free; reproduced by slowing the loop 0.5 s
# after each accept.) The garbage collector is off while the descriptors are used up, and the
# handshake waits long, so nothing frees one before the test does.
EMFILE_SCRIPT = """
import errno, gc, os, resource, sys, time
from pdserve.disagg.transport.tcp_receiver import ReceiverLimits, TcpReceiverServer
server = TcpReceiverServer(lambda *a: None, limits=ReceiverLimits(handshake_timeout_s=60))
print(server.port, flush=True)
gc.collect()
gc.disable()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
fillers = []
try:
    while True:
        fillers.append(os.open("/dev/null", os.O_RDONLY))
except OSError as e:
    assert e.errno == errno.EMFILE, e
print("full", flush=True)
sys.stdin.readline()  # the test's connections wait to be accepted
deadline = time.monotonic() + 60
while server.accept_errors == 0 and time.monotonic() < deadline:
    time.sleep(0.01)
errors = server.accept_errors
for fd in fillers:
    os.close(fd)
print(errors, flush=True)
sys.stdin.readline()
"""


def test_the_accept_loop_outlives_running_out_of_descriptors() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", EMFILE_SCRIPT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "full"  # its descriptors used up
        address = ("127.0.0.1", port)
        with (
            socket.create_connection(address, timeout=5) as first,
            socket.create_connection(address, timeout=5) as second,
        ):
            proc.stdin.write("\n")
            proc.stdin.flush()
            # accept() met EMFILE with a connection waiting (and counted it) before the
            # descriptors were freed
            assert int(proc.stdout.readline()) >= 1
            for sock in (first, second):
                open_handshake(sock, None)  # both accepted and served: the loop went on
        proc.stdin.write("\n")
        proc.stdin.flush()
    finally:
        proc.kill()
        proc.wait()
