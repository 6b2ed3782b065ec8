"""The cluster secret on both planes: a gRPC call without a valid token is UNAUTHENTICATED
before its handler runs; a KV connection that does not prove the secret is closed before a
byte reaches KV memory, and counted. With the secret, both work (and the full disaggregated
path, with TLS on gRPC too, is token-identical to the colocated engine)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import trustme

from pdserve.cli.configs import node_config
from pdserve.cli.flags import build_parser
from pdserve.config import ConfigError, Secret
from pdserve.disagg.auth import AUTH_METADATA, grpc_token
from pdserve.disagg.grpc_server import GrpcServer
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.disagg.transport.base import ACK_OK, encode_header
from pdserve.disagg.transport.handshake import HandshakeFailed, open_handshake
from tests.disagg.cluster import (
    assert_clean,
    decode_stub,
    generate,
    nodes,
    prefill_stub,
    start_pair,
)
from tests.disagg.kvfixtures import Receiver, connect

SECRET = Secret(b"correct horse battery staple")
WRONG = Secret(b"incorrect horse battery staple")


class Echo(pb_grpc.PrefillServiceServicer, pb_grpc.DecodeServiceServicer):
    """Handlers that count how often they ran."""

    def __init__(self) -> None:
        self.calls = 0

    async def GetPeerInfo(self, request: pb.PeerInfoRequest, context: object) -> pb.PeerInfo:
        self.calls += 1
        return pb.PeerInfo(tp_size=1, role="prefill")

    async def Prefill(self, request: pb.PrefillRequest, context: object) -> pb.PrefillResponse:
        self.calls += 1
        return pb.PrefillResponse(has_first_token=True, first_token=7)

    async def Generate(self, request: pb.GenerateRequest, context: object):  # type: ignore[no-untyped-def]
        self.calls += 1
        yield pb.GenerateResponse(token_ids=[7], finished=True)


async def call_both(metadata: list[tuple[str, str]] | None) -> tuple[grpc.StatusCode, ...]:
    """(GetPeerInfo's status, Generate's status) against a server holding SECRET."""
    server = GrpcServer("127.0.0.1", 0, 8, secret=SECRET)
    echo = Echo()
    assert server.server is not None
    pb_grpc.add_PrefillServiceServicer_to_server(echo, server.server)
    pb_grpc.add_DecodeServiceServicer_to_server(echo, server.server)
    await server.start()
    codes = []
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            for method, message, call in (
                (
                    "/pdserve.PrefillService/GetPeerInfo",
                    pb.PeerInfoRequest(),
                    lambda md: pb_grpc.PrefillServiceStub(ch).GetPeerInfo(
                        pb.PeerInfoRequest(), metadata=md, timeout=5
                    ),
                ),
                (
                    "/pdserve.DecodeService/Generate",
                    pb.GenerateRequest(token_ids=[1]),
                    lambda md: pb_grpc.DecodeServiceStub(ch).Generate(
                        pb.GenerateRequest(token_ids=[1]), metadata=md, timeout=5
                    ),
                ),
            ):
                md = metadata if metadata is not None else None
                if metadata == [("token", "for-the-method")]:
                    md = [(AUTH_METADATA, grpc_token(SECRET, method, message.SerializeToString()))]
                elif metadata == [("token", "for-another-message")]:
                    other = pb.GenerateRequest(token_ids=[2]).SerializeToString()
                    md = [(AUTH_METADATA, grpc_token(SECRET, method, other))]
                try:
                    result = call(md)
                    if hasattr(result, "__aiter__"):
                        async for _ in result:
                            pass
                    else:
                        await result
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
    finally:
        await server.stop(0)
    if any(c != grpc.StatusCode.OK for c in codes):
        assert echo.calls == codes.count(grpc.StatusCode.OK)  # refused before the handler
    return tuple(codes)


UNAUTH = (grpc.StatusCode.UNAUTHENTICATED,) * 2


def test_grpc_without_a_token_is_unauthenticated() -> None:
    assert asyncio.run(call_both(None)) == UNAUTH


def test_grpc_with_a_token_from_the_wrong_secret_is_unauthenticated() -> None:
    token = grpc_token(WRONG, "/pdserve.PrefillService/GetPeerInfo")
    assert asyncio.run(call_both([(AUTH_METADATA, token)]))[0] == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_token_replayed_on_another_method_or_stale_is_unauthenticated() -> None:
    other = grpc_token(SECRET, "/pdserve.PrefillService/Prefill")  # a token for another method
    assert asyncio.run(call_both([(AUTH_METADATA, other)])) == UNAUTH
    stale = grpc_token(SECRET, "/pdserve.PrefillService/GetPeerInfo", now=time.time() - 3600)
    assert asyncio.run(call_both([(AUTH_METADATA, stale)]))[0] == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_with_the_right_token_is_served() -> None:
    assert asyncio.run(call_both([("token", "for-the-method")])) == (grpc.StatusCode.OK,) * 2


def test_grpc_token_made_for_another_message_is_unauthenticated() -> None:
    """A token vouches for one message: captured (no TLS), it does not authorize another."""
    assert asyncio.run(call_both([("token", "for-another-message")])) == UNAUTH


def test_grpc_token_replayed_is_unauthenticated() -> None:
    """The same token (and message) sent twice: the second call is refused (nonce cache)."""

    async def twice() -> list[grpc.StatusCode]:
        server = GrpcServer("127.0.0.1", 0, 8, secret=SECRET)
        assert server.server is not None
        pb_grpc.add_PrefillServiceServicer_to_server(Echo(), server.server)
        await server.start()
        method = "/pdserve.PrefillService/GetPeerInfo"
        token = grpc_token(SECRET, method, pb.PeerInfoRequest().SerializeToString())
        codes = []
        try:
            async with grpc.aio.insecure_channel(server.address) as ch:
                for _ in range(2):
                    try:
                        await pb_grpc.PrefillServiceStub(ch).GetPeerInfo(
                            pb.PeerInfoRequest(), metadata=[(AUTH_METADATA, token)], timeout=5
                        )
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
        finally:
            await server.stop(0)
        return codes

    assert asyncio.run(twice()) == [grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED]


def test_unauthenticated_calls_that_never_send_their_message_hold_no_slot() -> None:
    """2,000 calls without credentials that send their headers and never their message (the
    server's call limit is 8 + 64 control calls): each is refused at its metadata, so an
    authenticated Prefill right after them is served."""

    async def scenario() -> tuple[list[grpc.StatusCode], grpc.StatusCode]:
        server = GrpcServer("127.0.0.1", 0, 8, secret=SECRET)
        echo = Echo()
        assert server.server is not None
        pb_grpc.add_PrefillServiceServicer_to_server(echo, server.server)
        await server.start()
        never = asyncio.Event()

        async def silence():  # type: ignore[no-untyped-def]
            await never.wait()  # the message never comes
            yield b""  # pragma: no cover

        method = "/pdserve.PrefillService/GetPeerInfo"

        async def status(call: Any) -> grpc.StatusCode:
            try:
                await call
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                return e.code()

        try:
            # Two clients, two connections: channels to one address share a connection unless
            # told not to, and the member's call would then queue behind the attacker's streams
            # on it (refused by HTTP/2 past its stream limit, as UNAVAILABLE, under load).
            own = [("grpc.use_local_subchannel_pool", 1)]
            async with (
                grpc.aio.insecure_channel(server.address, options=own) as attacker,
                grpc.aio.insecure_channel(server.address, options=own) as member,
            ):
                hold = attacker.stream_unary(method, request_serializer=bytes)
                held = [
                    asyncio.ensure_future(status(hold(silence(), timeout=30))) for _ in range(2000)
                ]
                await asyncio.sleep(1.0)  # all sent (the old interceptor held each one's slot)
                message = pb.PrefillRequest(request_id="r", unique_key="k", token_ids=[1, 2])
                prefill = "/pdserve.PrefillService/Prefill"
                token = grpc_token(SECRET, prefill, message.SerializeToString())
                served = await status(
                    pb_grpc.PrefillServiceStub(member).Prefill(
                        message, metadata=[(AUTH_METADATA, token)], timeout=10
                    )
                )
                codes = list(await asyncio.gather(*held))
        finally:
            never.set()
            await server.stop(0)
        assert echo.calls == (1 if served == grpc.StatusCode.OK else 0)
        return codes, served

    codes, served = asyncio.run(scenario())
    assert served == grpc.StatusCode.OK
    # Each refused: at its metadata; or (sent beyond the connection's stream limit before the
    # client learnt it) by HTTP/2 itself, which gRPC reports as UNAVAILABLE; or, arriving while
    # the server's call limit was full of calls being refused at their metadata (a busy host:
    # seen in CI), by that limit as RESOURCE_EXHAUSTED. None served, and none held a slot past
    # its refusal: the member's call above was served.
    assert grpc.StatusCode.UNAUTHENTICATED in codes
    refused = {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
    assert set(codes) <= refused


# ---- the transfer port ----------------------------------------------------------------------


@pytest.fixture
def guarded() -> Iterator[Receiver]:
    r = Receiver(secret=SECRET)
    r.register("live", [1, 2])
    yield r
    r.close()


def data_frame(r: Receiver) -> bytes:
    header = pb.TransferFrameHeader(
        kind=pb.TransferFrameHeader.DATA,
        unique_key="live",
        layer=0,
        block_ids=[1, 2],
        block_bytes=r.regions.block_bytes,
    )
    return encode_header(header) + b"\x7f" * (2 * r.regions.block_bytes)


def wait_count(get, value: int) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 5
    while get() < value and time.monotonic() < deadline:
        time.sleep(0.01)
    assert get() == value


def test_transfer_link_with_the_wrong_secret_is_closed_before_any_byte_reaches_kv(
    guarded: Receiver,
) -> None:
    before = guarded.snapshot()
    with pytest.raises((HandshakeFailed, ConnectionError)):
        connect(guarded.address, WRONG)
    wait_count(lambda: guarded.server.handshakes_failed, 1)
    host, port = guarded.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:  # no handshake at all
        raw.recv(64)  # the receiver's challenge
        with contextlib.suppress(OSError):  # closed already
            raw.sendall(data_frame(guarded))  # a frame where the answer should be
        try:
            answer = raw.recv(1)
        except ConnectionResetError:
            answer = b""
        assert answer == b""  # closed, no ACK
    wait_count(lambda: guarded.server.handshakes_failed, 2)
    assert all(torch.equal(a, b) for a, b in zip(before, guarded.caches, strict=True))
    assert guarded.store.bytes_received == 0


def test_transfer_link_with_the_secret_is_served(guarded: Receiver) -> None:
    sock = connect(guarded.address, SECRET)
    try:
        sock.sendall(data_frame(guarded))
        assert sock.recv(1) == bytes([ACK_OK])
    finally:
        sock.close()
    assert guarded.server.handshakes_failed == 0
    assert torch.all(guarded.caches[0][1].flatten().view(torch.uint8) == 0x7F)


def test_a_receiver_with_a_secret_refuses_a_sender_without_one(guarded: Receiver) -> None:
    with pytest.raises((HandshakeFailed, ConnectionError)):
        connect(guarded.address, None)
    wait_count(lambda: guarded.server.handshakes_failed, 1)


def test_a_sender_refuses_a_receiver_that_cannot_prove_the_secret() -> None:
    r = Receiver(secret=WRONG)
    try:
        host, port = r.address.rsplit(":", 1)
        with (
            socket.create_connection((host, int(port)), timeout=5) as sock,
            pytest.raises((HandshakeFailed, ConnectionError)),
        ):
            open_handshake(sock, SECRET)
    finally:
        r.close()


# ---- exposure -------------------------------------------------------------------------------


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser(lambda a: 0, lambda a: 0, lambda a: 0).parse_args(["prefill", *argv])


def test_a_node_exposed_beyond_loopback_without_a_secret_refuses_to_start(tmp_path: Path) -> None:
    for flags in (["--grpc-host", "0.0.0.0"], ["--transfer-host", "10.1.2.3"]):
        with pytest.raises(ConfigError, match="cluster-secret-file"):
            node_config(parse(*flags))
        assert node_config(parse(*flags, "--insecure")).insecure
    secret = tmp_path / "secret"
    secret.write_text("s" * 32 + "\n")
    for mode in (0o644, 0o640, 0o604, 0o620):  # others may read or change it: refused
        secret.chmod(mode)
        with pytest.raises(ConfigError, match=f"mode {mode:03o}"):
            node_config(parse("--cluster-secret-file", str(secret)))
    secret.chmod(0o600)
    exposed = ["--grpc-host", "0.0.0.0", "--cluster-secret-file", str(secret)]
    with pytest.raises(ConfigError, match="--tls-cert"):  # gRPC off loopback needs TLS too
        node_config(parse(*exposed))
    tls = ["--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem")]
    config = node_config(parse(*exposed, *tls))
    assert node_config(parse("--transfer-host", "10.1.2.3", "--cluster-secret-file", str(secret)))
    assert config.cluster_secret == Secret(b"s" * 32)
    assert "s" * 32 not in repr(config)  # the secret never prints
    secret.write_text("short")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        node_config(parse("--cluster-secret-file", str(secret)))


def test_a_decode_binding_every_address_must_say_where_prefill_reaches_it(tmp_path: Path) -> None:
    """`--transfer-host 0.0.0.0` names no address a prefill node could push KV to."""
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    decode = ["decode", "--prefill", "10.0.0.2:50051", "--cluster-secret-file", str(secret)]
    parser = build_parser(lambda a: 0, lambda a: 0, lambda a: 0)
    for wildcard in ("0.0.0.0", "::"):
        with pytest.raises(ConfigError, match="--advertise-host"):
            node_config(parser.parse_args([*decode, "--transfer-host", wildcard]))
        config = node_config(
            parser.parse_args(
                [*decode, "--transfer-host", wildcard, "--advertise-host", "10.0.0.3"]
            )
        )
        assert config.advertise_host == "10.0.0.3"
    # A prefill node binding every address pushes KV, it is not pushed to: nothing to name.
    assert node_config(parse("--transfer-host", "0.0.0.0", "--cluster-secret-file", str(secret)))


# ---- the whole path with the secret on, and TLS on gRPC -------------------------------------


def test_disaggregated_with_secret_and_tls_equals_colocated(  # type: ignore[no-untyped-def]
    tmp_path: Path, prompts, colocated
) -> None:
    secret_file = tmp_path / "cluster.secret"
    secret_file.write_bytes(SECRET.value)
    secret_file.chmod(0o600)
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_pem, key_pem, ca_pem = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_pem))
    cert.private_key_pem.write_to_path(str(key_pem))
    ca.cert_pem.write_to_path(str(ca_pem))
    auth = ["--cluster-secret-file", str(secret_file)]
    tls = ["--tls-cert", str(cert_pem), "--tls-key", str(key_pem)]
    prefill, decode = start_pair(
        prefill_args=[*auth, *tls], decode_args=[*auth, *tls, "--tls-ca", str(ca_pem)]
    )
    with nodes(prefill, decode):
        root = ca_pem.read_bytes()
        d = decode_stub(decode.address, SECRET, root)
        p = prefill_stub(prefill.address, SECRET, root)
        with ThreadPoolExecutor(4) as pool:  # at once: several transfers on the secured link
            results = list(pool.map(lambda pn: generate(d, *pn), prompts[:4]))
        assert all(remote for _, remote in results)
        assert [tokens for tokens, _ in results] == colocated[:4]
        with pytest.raises(grpc.RpcError) as e:  # the same node, without the secret
            generate(decode_stub(decode.address, None, root), prompts[0][0], 2)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert_clean(d, p)


def test_one_connection_carries_at_most_256_calls_at_once() -> None:
    """A client (authenticated or not) cannot open unbounded streams on one connection: at
    most 256 of its calls are in a handler at once, the rest wait on its side (HTTP/2's
    limit, which the server announces)."""

    async def scenario() -> int:
        server = GrpcServer("127.0.0.1", 0, 1000)
        assert server.server is not None
        inside, most = 0, 0
        release = asyncio.Event()

        class Held(pb_grpc.PrefillServiceServicer):  # type: ignore[misc]
            async def GetPeerInfo(
                self, request: pb.PeerInfoRequest, context: object
            ) -> pb.PeerInfo:
                nonlocal inside, most
                inside += 1
                most = max(most, inside)
                await release.wait()
                inside -= 1
                return pb.PeerInfo()

        pb_grpc.add_PrefillServiceServicer_to_server(Held(), server.server)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as ch:
                stub = pb_grpc.PrefillServiceStub(ch)
                calls = [
                    asyncio.ensure_future(stub.GetPeerInfo(pb.PeerInfoRequest(), timeout=30))
                    for _ in range(400)
                ]
                await asyncio.sleep(2.0)  # all 400 sent; had the limit not held, all are in
                seen = most
                release.set()
                results = await asyncio.gather(*calls, return_exceptions=True)
        finally:
            await server.stop(0)
        # Sent before the client learnt the limit, some are refused by HTTP/2 (UNAVAILABLE).
        for r in results:
            assert isinstance(r, pb.PeerInfo) or r.code() == grpc.StatusCode.UNAVAILABLE, r
        return seen

    assert 0 < asyncio.run(scenario()) <= 256
