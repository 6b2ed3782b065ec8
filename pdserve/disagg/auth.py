"""Authentication of the control plane (gRPC) with the cluster secret (never sent, never logged).

gRPC: every call carries `x-pdserve-auth: <unix time>.<nonce>.<digest>.<HMAC-SHA256(secret,
time.nonce.method.digest)>`, where digest is the SHA-256 of the call's request message. A server
interceptor checks it from the call's metadata alone, before the message is read: a missing,
wrong, stale (beyond `TOKEN_SKEW_S`) or replayed (its nonce seen before) token ends the call
UNAUTHENTICATED at once, so calls without the secret cannot hold slots by never sending their
message. Once the message arrives its digest must match the token's, so a token authorizes
one message of one method, once.
The KV links' own handshake is `transport/handshake.py`.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pdserve.config import ConfigError, Secret, TlsFiles

AUTH_METADATA = "x-pdserve-auth"
TOKEN_SKEW_S = 300.0  # clocks of the cluster agree to within this
MAX_NONCES = 1_000_000  # tokens remembered against replay (about 64 MB at most)


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


def message_digest(message: bytes) -> str:
    return hashlib.sha256(message).hexdigest()


def grpc_token(secret: Secret, method: str, message: bytes = b"", now: float | None = None) -> str:
    """A token for one call of `method` carrying the serialized request `message`."""
    stamp = str(int(now if now is not None else time.time()))
    nonce = secrets.token_hex(8)
    digest = message_digest(message)
    mac = _mac(secret, stamp.encode(), nonce.encode(), method.encode(), digest.encode()).hex()
    return f"{stamp}.{nonce}.{digest}.{mac}"


@dataclass(frozen=True)
class Token:
    """A token whose MAC and time checked out: its nonce and the digest it vouches for."""

    stamp: int
    nonce: str
    digest: str


def check_grpc_token(
    secret: Secret, method: str, token: str, now: float | None = None
) -> Token | None:
    """The token, if it is one for `method` under `secret` and within the clock skew."""
    try:
        stamp, nonce, digest, mac = token.split(".")
        age = abs((now if now is not None else time.time()) - int(stamp))
    except ValueError:
        return None
    expected = _mac(secret, stamp.encode(), nonce.encode(), method.encode(), digest.encode())
    if age > TOKEN_SKEW_S or not hmac.compare_digest(mac, expected.hex()):
        return None
    return Token(int(stamp), nonce, digest)


class NonceCache:
    """Nonces of tokens already used, kept as long as their token could still pass the clock
    check (2 x TOKEN_SKEW_S), at most `capacity` (the oldest forgotten first)."""

    def __init__(self, capacity: int = MAX_NONCES) -> None:
        self.capacity = capacity
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()

    def first_use(self, nonce: str, now: float) -> bool:
        while self._seen and (
            len(self._seen) >= self.capacity or next(iter(self._seen.values())) < now
        ):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return False
        self._seen[nonce] = now + 2 * TOKEN_SKEW_S
        return True


class ServerAuth(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc's classes are untyped (Any)
    """Refuses calls without a valid, fresh token at their metadata, and calls whose message
    is not the one the token vouches for once it arrives; counts both (`refused`)."""

    def __init__(self, secret: Secret) -> None:
        self.secret = secret
        self.refused = 0
        self.nonces = NonceCache()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = _method_name(details.method)
        token = dict(details.invocation_metadata or ()).get(AUTH_METADATA, "")
        checked = check_grpc_token(self.secret, method, token) if isinstance(token, str) else None
        handler = await continuation(details)
        if checked is None or not self.nonces.first_use(checked.nonce, time.time()):
            self.refused += 1
            return _deny_at_once(handler, "missing, invalid or replayed cluster credentials")
        if handler is None:
            return None
        return self._bound_to_message(handler, checked.digest)

    def _bound_to_message(
        self, handler: grpc.RpcMethodHandler, digest: str
    ) -> grpc.RpcMethodHandler:
        """`handler`, reading the request as (whether its digest is the token's, request)."""
        if handler.request_streaming:  # none of ours; nothing to bind a token to
            return _deny_at_once(handler, "streaming requests are not served")
        parse = handler.request_deserializer

        def read(raw: bytes) -> tuple[bool, Any]:
            ok = hmac.compare_digest(message_digest(raw), digest)
            return ok, (parse(raw) if ok and parse is not None else raw)

        auth = self
        message = "the request message is not the one the credentials were made for"
        if handler.response_streaming:
            inner_stream = handler.unary_stream

            async def stream(request: tuple[bool, Any], context: Any) -> AsyncIterator[Any]:
                ok, parsed = request
                if not ok:
                    auth.refused += 1
                    await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
                async for response in inner_stream(parsed, context):
                    yield response

            return handler._replace(request_deserializer=read, unary_stream=stream)
        inner = handler.unary_unary

        async def unary(request: tuple[bool, Any], context: Any) -> Any:
            ok, parsed = request
            if not ok:
                auth.refused += 1
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            return await inner(parsed, context)

        return handler._replace(request_deserializer=read, unary_unary=unary)


def _deny_at_once(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler that ends the call UNAUTHENTICATED without waiting for its message: served
    as a request stream, its behaviour runs at once and never reads."""
    ser = handler.response_serializer if handler is not None else None

    async def unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    if handler is not None and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, response_serializer=ser)
    return grpc.stream_unary_rpc_method_handler(unary, response_serializer=ser)


def _serialized(request: Any) -> bytes:
    data: bytes = request.SerializeToString()
    return data


class _ClientAuth:
    def __init__(self, secret: Secret) -> None:
        self.secret = secret

    def _details(
        self, details: grpc.aio.ClientCallDetails, request: Any
    ) -> grpc.aio.ClientCallDetails:
        token = grpc_token(self.secret, _method_name(details.method), _serialized(request))
        metadata = grpc.aio.Metadata(*(details.metadata or ()), (AUTH_METADATA, token))
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnaryAuth(_ClientAuth, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]  # grpc's classes are untyped (Any)
    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]  # grpc's interceptor signature
        return await continuation(self._details(details, request), request)


class _UnaryStreamAuth(_ClientAuth, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]  # grpc's classes are untyped (Any)
    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]  # grpc's interceptor signature
        return await continuation(self._details(details, request), request)


def client_interceptors(secret: Secret | None) -> list[grpc.aio.ClientInterceptor]:
    return [] if secret is None else [_UnaryUnaryAuth(secret), _UnaryStreamAuth(secret)]


class SyncClientAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]  # grpc's classes are untyped (Any)
    """The same token on a blocking channel (tools and tests):
    `grpc.intercept_channel(channel, SyncClientAuth(secret))`."""

    def __init__(self, secret: Secret) -> None:
        self.secret = secret

    def _details(self, details: Any, request: Any) -> Any:
        # grpc's blocking call details are a namedtuple: a copy with the token added.
        token = grpc_token(self.secret, _method_name(details.method), _serialized(request))
        return details._replace(metadata=[*(details.metadata or ()), (AUTH_METADATA, token)])

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]  # grpc's interceptor signature
        return continuation(self._details(details, request), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]  # grpc's interceptor signature
        return continuation(self._details(details, request), request)
