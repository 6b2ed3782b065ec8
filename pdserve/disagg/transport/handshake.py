"""The mutual challenge-response that opens every KV link, over the cluster secret.

A connection opens with it before any frame is read: the receiver sends `MAGIC + nonce_r`,
the sender answers `nonce_s + HMAC(secret, "sender" | nonce_r | nonce_s)`, the receiver
checks it and answers `HMAC(secret, "receiver" | nonce_r | nonce_s)`, which the sender
checks. Both nonces are fresh, so neither proof can be replayed on another connection.
Without a secret the same exchange runs with an empty key: a node with a secret refuses a
peer without one, and the wire format never depends on configuration. Bounded in total
time: a peer dripping a byte at a time cannot stretch it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time

from pdserve.config import Secret
from pdserve.disagg.transport.sockets import kernel_timeout, recv_exact_into, send_all

MAGIC = b"PDKV1\n"
NONCE_BYTES = 16
DIGEST_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0


class HandshakeFailed(ConnectionError):
    """The peer did not prove it holds the cluster secret (or spoke another protocol)."""


def _mac(secret: Secret | None, *parts: bytes) -> bytes:
    key = secret.value if secret is not None else b""
    return hmac.new(key, b"|".join(parts), hashlib.sha256).digest()


def _recv_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, [memoryview(buf)], deadline)
    return bytes(buf)


def _send_by(sock: socket.socket, data: bytes, deadline: float) -> None:
    send_all(sock, [data], deadline)


def _blocking_until_done(sock: socket.socket) -> None:
    """Before a handshake: a blocking socket (each call is bounded in the kernel by the
    handshake's deadline)."""
    sock.settimeout(None)


def _unbounded(sock: socket.socket) -> None:
    """After a handshake: the kernel bounds it set are lifted (the link sets its own)."""
    kernel_timeout(sock, socket.SO_RCVTIMEO, 0)
    kernel_timeout(sock, socket.SO_SNDTIMEO, 0)


def accept_handshake(
    sock: socket.socket, secret: Secret | None, timeout_s: float = HANDSHAKE_TIMEOUT_S
) -> None:
    """Receiver side: prove the sender holds the secret, then prove we do, all within
    `timeout_s` in total (a peer sending a byte at a time cannot stretch it). Raises
    HandshakeFailed (or OSError, TimeoutError); nothing else is read from the socket before it
    returns."""
    deadline = time.time() + timeout_s
    _blocking_until_done(sock)
    try:
        ours = os.urandom(NONCE_BYTES)
        _send_by(sock, MAGIC + ours, deadline)
        answer = _recv_by(sock, NONCE_BYTES + DIGEST_BYTES, deadline)
        theirs, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(proof, _mac(secret, b"sender", ours, theirs)):
            raise HandshakeFailed("the sender did not prove the cluster secret")
        _send_by(sock, _mac(secret, b"receiver", ours, theirs), deadline)
    finally:
        _unbounded(sock)


def open_handshake(
    sock: socket.socket, secret: Secret | None, timeout_s: float = HANDSHAKE_TIMEOUT_S
) -> None:
    """Sender side of `accept_handshake` (within `timeout_s` in total, at most the handshake
    limit)."""
    deadline = time.time() + min(timeout_s, HANDSHAKE_TIMEOUT_S)
    _blocking_until_done(sock)
    try:
        hello = _recv_by(sock, len(MAGIC) + NONCE_BYTES, deadline)
        if not hello.startswith(MAGIC):
            raise HandshakeFailed("the peer is not a pdserve KV receiver")
        theirs = hello[len(MAGIC) :]
        ours = os.urandom(NONCE_BYTES)
        _send_by(sock, ours + _mac(secret, b"sender", theirs, ours), deadline)
        proof = _recv_by(sock, DIGEST_BYTES, deadline)
        if not hmac.compare_digest(proof, _mac(secret, b"receiver", theirs, ours)):
            raise HandshakeFailed("the receiver did not prove the cluster secret")
    finally:
        _unbounded(sock)
