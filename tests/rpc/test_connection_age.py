"""--max-connection-age: clients reconnect now and then (so that a Service spreads them), calls in flight finish.

gRPC on a real ManagedServer (a test service that answers with the caller's address as the server sees it, so that a
new connection shows as a new client port), and the HTTP API's hook alone on a fake clock (the coordinator's real
HTTP app: tests/http/test_http_connection_age.py).
"""

from __future__ import annotations

import asyncio
import gc
import random

import grpc
import pytest

from tandem.config import ServerOptions
from tandem.errors import InvalidRequestError
from tandem.rpc.connection_age import JITTER, ConnectionAge
from tandem.rpc.server import ManagedServer
from tests.serving import serving

AGE_S = 0.3


def peer_server(max_age_s: float | None) -> ManagedServer:
    server = ManagedServer("test", ServerOptions(host="127.0.0.1", port=0, drain_grace_s=0,
                                                 max_connection_age_s=max_age_s))

    async def peer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return context.peer().encode()

    async def slow_peers(request: bytes, context: grpc.aio.ServicerContext):
        for _ in range(6):  # 1.2 s: four connection ages
            await asyncio.sleep(0.2)
            yield context.peer().encode()

    server.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Peer", {
        "Unary": grpc.unary_unary_rpc_method_handler(peer),
        "Stream": grpc.unary_stream_rpc_method_handler(slow_peers)}),))
    return server


@pytest.mark.parametrize("max_age_s", [AGE_S, None])
def test_a_grpc_client_reconnects_after_the_age_and_its_calls_in_flight_finish(max_age_s):
    """Calls 1.5 s long reach the server from more than one connection with an age of 0.3 s (from one without); a
    stream longer than four ages gets every message, on the connection it started on; no call fails."""
    async def go():
        async with serving(peer_server(max_age_s)) as address, grpc.aio.insecure_channel(address) as channel:
            unary = channel.unary_unary("/test.Peer/Unary")
            stream = channel.unary_stream("/test.Peer/Stream")
            streamed = asyncio.ensure_future(_collect(stream(b"")))
            peers = set()
            for _ in range(15):
                peers.add(await unary(b"", timeout=5))
                await asyncio.sleep(0.1)
            stream_peers = await streamed
            assert len(stream_peers) == 6 and len(set(stream_peers)) == 1
            assert len(peers) >= 2 if max_age_s else peers == set(stream_peers)
    asyncio.run(go())


async def _collect(call) -> list[bytes]:
    return [message async for message in call]


class _Transport:
    """Stands for an asyncio transport: only its identity (and weak references to it) matter."""


class _Request:
    def __init__(self, transport: _Transport | None) -> None:
        self.transport = transport


class _Response:
    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.keep_alive: bool | None = None

    def force_close(self) -> None:
        self.keep_alive = False


def test_the_http_hook_closes_each_connection_after_its_own_jittered_age_and_forgets_closed_ones():
    now = [100.0]
    hook = ConnectionAge(10.0, clock=lambda: now[0], rng=random.Random(7))

    def closes(transport) -> bool:
        response = _Response()
        asyncio.run(hook.on_response_prepare(_Request(transport), response))
        closed = response.keep_alive is False
        assert closed == (response.headers.get("Connection") == "close")  # (the header tells the client)
        return closed

    a, b = _Transport(), _Transport()
    assert not closes(a)
    now[0] += 5.0
    assert not closes(a) and not closes(b)  # b's age counts from now
    now[0] += 10.0 * (1 - JITTER) - 5.0 - 0.01
    assert not closes(a)  # never before 90% of the age
    now[0] += 10.0 * 2 * JITTER + 0.02
    assert closes(a) and not closes(b)  # a is past 110% of its age; b is 6 s old
    now[0] += 5.0
    assert closes(b) and not closes(None)  # (a request whose client is gone: nothing to close)
    del a, b
    gc.collect()
    assert len(hook._deadlines) == 0


@pytest.mark.parametrize("age", [0.0, -1.0])
def test_a_connection_age_must_be_positive(age):
    with pytest.raises(InvalidRequestError, match="--max-connection-age must be a positive number of seconds"):
        ServerOptions(max_connection_age_s=age)
