"""Property-based fuzzing of the KV receiver (hypothesis) against a live pool full of canaries:
random headers (or raw garbage), keys, layers, block lists (duplicates, out of range, foreign),
sizes, head slices, truncated payloads and FAILURE frames, each on its own authenticated
connection. The receiver never crashes, never writes a byte outside the live blocks of the
frame's own key, and counts every complete frame it does not accept."""

from __future__ import annotations

import contextlib
import itertools
import socket
import struct
import threading
import time
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.config import Secret
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.transport.base import ACK_OK, encode_header, nack_byte
from tests.disagg.kvfixtures import NUM_BLOCKS, NUM_LAYERS, Receiver, connect

SECRET = Secret(b"fuzzing-secret-0123456789")
CANARY = 0x33
PAYLOAD = 0xA5
LIVE_BLOCKS = [2, 3, 5]  # every example's live key owns these


@dataclass
class Case:
    header: pb.TransferFrameHeader | None  # None: `garbage` is sent as the header body
    garbage: bytes
    payload_blocks: int  # blocks of payload sent
    truncate: int  # bytes cut from the payload's end (0: complete)


def headers(block_bytes: int) -> st.SearchStrategy[pb.TransferFrameHeader]:
    return st.builds(
        lambda kind, key, layer, blocks, size, head_start, head_count: pb.TransferFrameHeader(
            kind=kind,
            unique_key=key,
            layer=layer,
            block_ids=blocks,
            block_bytes=size,
            head_start=head_start,
            head_count=head_count,
        ),
        kind=st.sampled_from([pb.TransferFrameHeader.DATA, pb.TransferFrameHeader.FAILURE]),
        key=st.sampled_from(["LIVE", "unknown", "cancelled"]),
        layer=st.integers(0, NUM_LAYERS + 2),
        blocks=st.lists(st.integers(0, NUM_BLOCKS + 3), max_size=5),
        size=st.sampled_from([block_bytes, block_bytes, block_bytes - 8, block_bytes + 8, 0]),
        head_start=st.sampled_from([0, 0, 0, 1]),
        head_count=st.sampled_from([0, 2, 2, 1, 3]),
    )


def cases(block_bytes: int) -> st.SearchStrategy[Case]:
    framed = st.builds(
        lambda h, extra, cut: Case(h, b"", max(0, len(h.block_ids) + extra), cut),
        headers(block_bytes),
        st.sampled_from([0, 0, 0, -1, 1]),
        st.sampled_from([0, 0, 0, 1, block_bytes // 2]),
    )
    garbage = st.builds(lambda g: Case(None, g, 0, 0), st.binary(max_size=64))
    return st.one_of(framed, garbage)


def exchange(address: str, data: bytes, half_close: bool) -> bytes:
    """Send `data` on a fresh authenticated connection; the receiver's answer (b"": closed)."""
    sock = connect(address, SECRET)
    try:
        with contextlib.suppress(OSError):
            sock.sendall(data)
        if half_close:
            with contextlib.suppress(OSError):  # the receiver may have closed already
                sock.shutdown(socket.SHUT_WR)
        try:
            answer = sock.recv(1)
        except (ConnectionResetError, TimeoutError):
            return b""
        if half_close:
            # The receiver reads on past an answer (bytes beyond the frame are its next header)
            # until our half-close: wait for it to close, so that everything it counts for
            # this connection is counted before the next example looks.
            with contextlib.suppress(ConnectionResetError, TimeoutError):
                while sock.recv(4096):
                    pass
        return answer
    finally:
        sock.close()


def rejections(r: Receiver) -> int:
    return sum(r.store.frames_rejected.values()) + r.server.headers_rejected


def test_fuzzed_frames_never_crash_never_write_outside_the_key_and_are_counted() -> None:
    r = Receiver(secret=SECRET)
    keys = itertools.count()
    baseline_threads = threading.active_count()
    try:
        size = r.regions.block_bytes
        for cache in r.caches:
            cache.view(torch.uint8).fill_(CANARY)
        r.register("cancelled", [7])
        r.store.cancel("cancelled")

        @settings(
            max_examples=120,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(case=cases(size))
        def check(case: Case) -> None:
            live = f"live-{next(keys)}"
            r.register(live, LIVE_BLOCKS)
            for cache in r.caches:  # each example starts from a pool full of canaries
                cache.view(torch.uint8).fill_(CANARY)
            if case.header is not None:
                header = pb.TransferFrameHeader()
                header.CopyFrom(case.header)
                if header.unique_key == "LIVE":
                    header.unique_key = live
                payload = bytes([PAYLOAD]) * max(0, case.payload_blocks * header.block_bytes)
                payload = payload[: max(0, len(payload) - case.truncate)]
                data = encode_header(header) + payload
                complete = case.truncate == 0 and case.payload_blocks == len(header.block_ids)
            else:
                header = None
                data = struct.pack(">I", len(case.garbage)) + case.garbage
                complete = True
            before = rejections(r)
            answer = exchange(r.address, data, half_close=not complete)
            # Only the live key's own blocks may have changed, and only by a DATA frame for it.
            writable = (
                set(LIVE_BLOCKS) if header is not None and header.unique_key == live else set()
            )
            for cache in r.caches:
                touched = (cache.view(torch.uint8).reshape(NUM_BLOCKS, -1) != CANARY).any(dim=1)
                changed = {int(b) for b in torch.nonzero(touched).flatten()}
                assert changed <= writable, f"wrote blocks {changed - writable}"
            if answer == bytes([ACK_OK]):
                assert header is not None and header.unique_key == live
            elif complete:
                assert answer == b"" or answer[0] >= nack_byte("unknown_key")
                assert rejections(r) == before + 1, f"answer {answer!r} not counted once"
            r.store.cancel(live)

        check()
        # Still serving: a well-formed frame on a fresh connection is written and acknowledged.
        r.register("after", [1])
        header = pb.TransferFrameHeader(
            kind=pb.TransferFrameHeader.DATA, unique_key="after", layer=0, block_ids=[1],
            block_bytes=size,
        )  # fmt: skip
        assert exchange(r.address, encode_header(header) + b"\x11" * size, False) == bytes([ACK_OK])
        assert torch.all(r.caches[0][1].flatten().view(torch.uint8) == 0x11)
        deadline = time.monotonic() + 10  # connection threads end once their peer is gone
        while threading.active_count() > baseline_threads + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threading.active_count() <= baseline_threads + 1
    finally:
        r.close()


def test_a_failure_frame_from_another_connection_touches_nothing() -> None:
    r = Receiver(secret=SECRET)
    try:
        size = r.regions.block_bytes
        r.register("k", [1, 2])
        first = connect(r.address, SECRET)
        other = connect(r.address, SECRET)
        try:
            data = pb.TransferFrameHeader(
                kind=pb.TransferFrameHeader.DATA, unique_key="k", layer=0, block_ids=[1, 2],
                block_bytes=size,
            )  # fmt: skip
            first.sendall(encode_header(data) + b"\x7f" * 2 * size)  # binds k to `first`
            assert first.recv(1) == bytes([ACK_OK])
            failure = pb.TransferFrameHeader(
                kind=pb.TransferFrameHeader.FAILURE,
                unique_key="k",
                error="forged",
                reason="cancelled",
            )
            other.sendall(encode_header(failure))
            assert other.recv(1) == bytes([nack_byte("foreign_link")])
            progress = r.store.progress("k")
            assert progress is not None and progress.stage.name == "TRANSFERRING"  # not failed
            assert r.store.frames_rejected.get("foreign_link") == 1
            stray = pb.TransferFrameHeader(
                kind=pb.TransferFrameHeader.DATA, unique_key="k", layer=1, block_ids=[1, 2],
                block_bytes=size,
            )  # fmt: skip
            other.sendall(encode_header(stray) + b"\x01" * 2 * size)  # data too: refused
            assert other.recv(1) == bytes([nack_byte("foreign_link")])
            assert torch.all(r.caches[1][1].flatten().view(torch.uint8) == 0)
            first.sendall(encode_header(failure))  # the bound connection may fail it
            assert first.recv(1) == bytes([ACK_OK])
            claimed = r.store.claim("k")
            assert claimed is not None and claimed.failure is not None
        finally:
            first.close()
            other.close()
    finally:
        r.close()
