"""Authentication of the cluster's planes with one shared secret (never sent, never logged).

gRPC: every call carries `x-pdserve-auth: <unix time>.<nonce>.<HMAC-SHA256(secret, time.nonce.
method)>`; a server interceptor refuses a missing, wrong or stale (beyond `TOKEN_SKEW_S`)
token with UNAUTHENTICATED before the handler runs. A token names its method, so it cannot be
replayed against another one.

KV transfer: a connection opens with a mutual challenge-response before any frame is read:
the receiver sends `MAGIC + nonce_r`, the sender answers `nonce_s + HMAC(secret, "sender" |
nonce_r | nonce_s)`, the receiver checks it and answers `HMAC(secret, "receiver" | nonce_r |
nonce_s)`, which the sender checks. Both nonces are fresh, so neither proof can be replayed on
another connection. Without a secret the same exchange runs with an empty key: a node with a
secret refuses a peer without one, and the wire format never depends on configuration.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from pdserve.config import ConfigError, Secret, TlsFiles
from pdserve.disagg.transport.sockets import recv_exact

AUTH_METADATA = "x-pdserve-auth"
TOKEN_SKEW_S = 300.0  # clocks of the cluster agree to within this
MAGIC = b"PDKV1\n"
NONCE_BYTES = 16
DIGEST_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0


class HandshakeFailed(ConnectionError):
    """The peer did not prove it holds the cluster secret (or spoke another protocol)."""


def _key(secret: Secret | None) -> bytes:
    return secret.value if secret is not None else b""


def _mac(secret: Secret | None, *parts: bytes) -> bytes:
    return hmac.new(_key(secret), b"|".join(parts), hashlib.sha256).digest()


# ---- gRPC ---------------------------------------------------------------------------------


def _read(path: str | None) -> bytes:
    assert path is not None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(_read(tls.key), _read(tls.cert))])


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """Trust `tls.ca` (a private CA or the server's own certificate)."""
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca))


def _method_name(method: str | bytes) -> str:
    return method.decode() if isinstance(method, bytes) else method


def grpc_token(secret: Secret, method: str, now: float | None = None) -> str:
    stamp = str(int(now if now is not None else time.time()))
    nonce = secrets.token_hex(8)
    mac = _mac(secret, stamp.encode(), nonce.encode(), method.encode()).hex()
    return f"{stamp}.{nonce}.{mac}"


def check_grpc_token(secret: Secret, method: str, token: str, now: float | None = None) -> bool:
    try:
        stamp, nonce, mac = token.split(".")
        age = abs((now if now is not None else time.time()) - int(stamp))
    except ValueError:
        return False
    expected = _mac(secret, stamp.encode(), nonce.encode(), method.encode()).hex()
    return age <= TOKEN_SKEW_S and hmac.compare_digest(mac, expected)


class ServerAuth(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc's classes are untyped (Any)
    """Refuses calls without a valid token; counts them (`refused`)."""

    def __init__(self, secret: Secret) -> None:
        self.secret = secret
        self.refused = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = _method_name(details.method)
        token = dict(details.invocation_metadata or ()).get(AUTH_METADATA, "")
        handler = await continuation(details)
        if isinstance(token, str) and check_grpc_token(self.secret, method, token):
            return handler
        self.refused += 1
        return _deny(handler)


def _deny(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    message = "missing or invalid cluster credentials"

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    des = handler.request_deserializer if handler is not None else None
    ser = handler.response_serializer if handler is not None else None
    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=des, response_serializer=ser
        )
    return grpc.unary_unary_rpc_method_handler(
        unary, request_deserializer=des, response_serializer=ser
    )


class _ClientAuth:
    def __init__(self, secret: Secret) -> None:
        self.secret = secret

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        token = grpc_token(self.secret, _method_name(details.method))
        metadata = grpc.aio.Metadata(*(details.metadata or ()), (AUTH_METADATA, token))
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnaryAuth(_ClientAuth, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]  # grpc's classes are untyped (Any)
    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]  # grpc's interceptor signature
        return await continuation(self._details(details), request)


class _UnaryStreamAuth(_ClientAuth, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]  # grpc's classes are untyped (Any)
    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]  # grpc's interceptor signature
        return await continuation(self._details(details), request)


def client_interceptors(secret: Secret | None) -> list[grpc.aio.ClientInterceptor]:
    return [] if secret is None else [_UnaryUnaryAuth(secret), _UnaryStreamAuth(secret)]


class SyncClientAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]  # grpc's classes are untyped (Any)
    """The same token on a blocking channel (tools and tests):
    `grpc.intercept_channel(channel, SyncClientAuth(secret))`."""

    def __init__(self, secret: Secret) -> None:
        self.secret = secret

    def _details(self, details: Any) -> Any:
        # grpc's blocking call details are a namedtuple: a copy with the token added.
        token = grpc_token(self.secret, _method_name(details.method))
        return details._replace(metadata=[*(details.metadata or ()), (AUTH_METADATA, token)])

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]  # grpc's interceptor signature
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]  # grpc's interceptor signature
        return continuation(self._details(details), request)


# ---- KV transfer links --------------------------------------------------------------------


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def accept_handshake(sock: socket.socket, secret: Secret | None) -> None:
    """Receiver side: prove the sender holds the secret, then prove we do. Raises
    HandshakeFailed (or OSError); nothing else is read from the socket before it returns."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        ours = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + ours)
        answer = _recv_exactly(sock, NONCE_BYTES + DIGEST_BYTES)
        theirs, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(proof, _mac(secret, b"sender", ours, theirs)):
            raise HandshakeFailed("the sender did not prove the cluster secret")
        sock.sendall(_mac(secret, b"receiver", ours, theirs))
    finally:
        sock.settimeout(None)


def open_handshake(
    sock: socket.socket, secret: Secret | None, timeout_s: float = HANDSHAKE_TIMEOUT_S
) -> None:
    """Sender side of `accept_handshake` (within `timeout_s`, at most the handshake limit)."""
    sock.settimeout(min(timeout_s, HANDSHAKE_TIMEOUT_S))
    try:
        hello = _recv_exactly(sock, len(MAGIC) + NONCE_BYTES)
        if not hello.startswith(MAGIC):
            raise HandshakeFailed("the peer is not a pdserve KV receiver")
        theirs = hello[len(MAGIC) :]
        ours = os.urandom(NONCE_BYTES)
        sock.sendall(ours + _mac(secret, b"sender", theirs, ours))
        proof = _recv_exactly(sock, DIGEST_BYTES)
        if not hmac.compare_digest(proof, _mac(secret, b"receiver", theirs, ours)):
            raise HandshakeFailed("the receiver did not prove the cluster secret")
    finally:
        sock.settimeout(None)
