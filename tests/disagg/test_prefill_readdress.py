"""A decode's prefill node restarted on another address (Ray placed it on another machine):
once told (`PrefillClient.readdress`, what a router's `POST /admin/prefill-address` does), the
decode calls it there — a real gRPC peer on loopback, the old address dead — and no longer
knows the old one."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.disagg.prefill_client import PrefillCallError, PrefillClient, ProbePolicy
from pdserve.disagg.proto import pdserve_pb2 as pb
from pdserve.disagg.proto import pdserve_pb2_grpc as pb_grpc
from tests.disagg.cluster import free_port
from tests.disagg.test_failure_reasons import FINGERPRINT, ScriptedPrefill


def test_a_readdressed_prefill_node_is_called_at_its_new_address() -> None:
    async def scenario() -> None:
        calls: list[str] = []

        async def prefill(context: grpc.aio.ServicerContext) -> None:
            calls.append("new")

        server = grpc.aio.server()
        new = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        pb_grpc.add_PrefillServiceServicer_to_server(ScriptedPrefill(prefill), server)
        await server.start()
        old, other = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"  # nobody listens
        client = PrefillClient([old, other], FINGERPRINT, probes=ProbePolicy(cap_s=0.5))
        request = pb.PrefillRequest(
            request_id="r", unique_key="r-k", token_ids=[1, 2], deadline_unix=time.time() + 30
        )
        try:
            with pytest.raises(PrefillCallError):  # both dead
                await client.prefill(request, prefer=old)
            assert client.readdress("127.0.0.1:9", new) is None  # not one of ours
            gone = client.readdress(old, new)
            assert gone is not None and gone.address == old
            await gone.channel.close()
            assert client.knows(new) and not client.knows(old)
            assert [p.address for p in client.peers] == [new, other]  # its place kept
            address, response = await client.prefill(request, prefer=new)
            assert (address, response.has_first_token, calls) == (new, True, ["new"])
            # Told that another one moved where one of ours already is: the old one just goes.
            assert client.readdress(other, new) is not None
            assert [p.address for p in client.peers] == [new]
        finally:
            await client.close()
            await server.stop(0)

    asyncio.run(scenario())
