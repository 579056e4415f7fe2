"""The public API's guards on a real gRPC server: bearer tokens, per-client concurrency, malformed and large messages.

The servicer is a small stand-in for GenerationService (which needs a tokenizer
and workers); the server around it is the coordinator's own: ManagedServer with
the error mapping and the AccessControl interceptor, as coordinator/main.py
builds it. Health is the real grpc.health.v1.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2

from coordinator.access import AccessControl, peer_host
from tandem.rpc.auth import BearerAuth, bearer_metadata
from tandem.rpc.tls import open_channel
from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.serving import health_status, managed_server, serving

TOKEN_A = "token-a-0123456789abcdef"
TOKEN_B = "token-b-0123456789abcdef"
AS_A, AS_B = bearer_metadata(TOKEN_A), bearer_metadata(TOKEN_B)


class EchoGeneration(generation_pb2_grpc.GenerationServicer):
    """Answers with the request's text; holds each call until ``release`` is set (to test concurrency)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.release.set()
        self.running = 0

    async def Generate(self, request, context):
        self.running += 1
        try:
            await self.release.wait()
        finally:
            self.running -= 1
        return generation_pb2.GenerateResponse(text=request.text, finish_reason="length")

    async def GenerateStream(self, request, context):
        for part in (request.text, "!"):
            yield generation_pb2.GenerateStreamResponse(text=part)

    async def Info(self, request, context):
        return generation_pb2.InfoResponse(vocab_size=7)


@contextlib.asynccontextmanager
async def coordinator_like(auth: BearerAuth | None = None, max_concurrent: int = 0, max_receive_bytes: int = 1 << 22):
    servicer = EchoGeneration()
    server = managed_server(role="coordinator", interceptors=[AccessControl(auth, max_concurrent)],
                            max_receive_bytes=max_receive_bytes)
    server.add_service(generation_pb2_grpc.add_GenerationServicer_to_server, servicer, "tandem.v1.Generation")
    async with serving(server) as address, open_channel(address, None, aio=True) as channel:
        yield servicer, channel, address


def stub(channel) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(channel)


def raw_generate(channel):
    """Generate with bytes in and out: what any client can put on the wire."""
    return channel.unary_unary("/tandem.v1.Generation/Generate")


async def status_of(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


def test_bearer_token_required_on_generation_but_not_on_health():
    auth = BearerAuth((TOKEN_A, TOKEN_B))

    async def scenario():
        async with coordinator_like(auth) as (_, channel, address):
            request = generation_pb2.GenerateRequest(text="hi")
            missing = await status_of(stub(channel).Generate(request, timeout=5))
            assert missing.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer <token>" in missing.details()
            wrong = "wrong-0123456789abcdef-SECRET"
            for metadata in (bearer_metadata(wrong), (("authorization", "Basic " + TOKEN_A),),
                             (("authorization", "Bearer " + TOKEN_A[:-1]),)):
                bad = await status_of(stub(channel).Generate(request, timeout=5, metadata=metadata))
                assert bad.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "not valid" in bad.details() and "SECRET" not in bad.details() and TOKEN_A not in bad.details()
            streamed = stub(channel).GenerateStream(request, timeout=5)
            assert (await status_of(streamed.read())).code() == grpc.StatusCode.UNAUTHENTICATED
            assert (await status_of(stub(channel).Info(generation_pb2.InfoRequest(), timeout=5))).code() == \
                grpc.StatusCode.UNAUTHENTICATED
            for token in (TOKEN_A, TOKEN_B):
                reply = await stub(channel).Generate(request, timeout=5, metadata=bearer_metadata(token))
                assert reply.text == "hi"
                chunks = [c.text async for c in stub(channel).GenerateStream(
                    request, timeout=5, metadata=bearer_metadata(token))]
                assert chunks == ["hi", "!"]
            # orchestrator probes carry no token
            assert await health_status(address) == health_pb2.HealthCheckResponse.SERVING
    asyncio.run(scenario())


def test_unauthenticated_garbage_is_refused_for_the_token_before_it_is_parsed():
    async def scenario():
        async with coordinator_like(BearerAuth((TOKEN_A,))) as (_, channel, _address):
            error = await status_of(raw_generate(channel)(b"\xff\xff\xff", timeout=5))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            error = await status_of(raw_generate(channel)(b"\xff\xff\xff", timeout=5, metadata=AS_A))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    asyncio.run(scenario())


@pytest.mark.parametrize("payload,why", [
    (b"\xff\xff\xff", "Wire format was corrupt"),
    (b"\x0a\x02\xff\xfe", "bad UTF-8"),  # field 1 (text), 2 bytes of invalid UTF-8
    (b"\x12\x05\x08", "truncated"),  # token_ids, length 5, one byte present
])
def test_a_message_that_does_not_parse_is_invalid_argument_not_unknown(payload, why):
    async def scenario():
        async with coordinator_like() as (_, channel, _address):
            error = await status_of(raw_generate(channel)(payload, timeout=5))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
            assert error.details().startswith("malformed request: Error parsing message with type "
                                              "'tandem.v1.GenerateRequest'"), error.details()
            stream = channel.unary_stream("/tandem.v1.Generation/GenerateStream")(payload, timeout=5)
            assert (await status_of(stream.read())).code() == grpc.StatusCode.INVALID_ARGUMENT
            # and the server still answers well-formed requests
            assert (await stub(channel).Generate(generation_pb2.GenerateRequest(text="ok"), timeout=5)).text == "ok"
    asyncio.run(scenario())


def test_a_request_over_the_size_limit_is_resource_exhausted_by_grpc():
    async def scenario():
        async with coordinator_like(max_receive_bytes=2048) as (_, channel, _address):
            error = await status_of(stub(channel).Generate(generation_pb2.GenerateRequest(text="x" * 4096), timeout=5))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in error.details()
            assert (await stub(channel).Generate(generation_pb2.GenerateRequest(text="x" * 1000), timeout=5)).text
    asyncio.run(scenario())


def test_concurrent_requests_per_client_are_limited_and_freed_when_they_finish():
    async def scenario():
        async with coordinator_like(max_concurrent=2) as (servicer, channel, _address):
            servicer.release.clear()
            request = generation_pb2.GenerateRequest(text="hi")
            held = [asyncio.ensure_future(stub(channel).Generate(request, timeout=10)) for _ in range(2)]
            while servicer.running < 2:
                await asyncio.sleep(0.01)
            error = await status_of(stub(channel).Generate(request, timeout=5))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "at most 2" in error.details()
            servicer.release.set()
            assert [r.text for r in await asyncio.gather(*held)] == ["hi", "hi"]
            # slots come back, also from a cancelled call
            servicer.release.clear()
            cancelled = stub(channel).Generate(request, timeout=10)
            while servicer.running < 1:
                await asyncio.sleep(0.01)
            cancelled.cancel()
            while servicer.running:
                await asyncio.sleep(0.01)
            servicer.release.set()
            replies = await asyncio.gather(*(stub(channel).Generate(request, timeout=5) for _ in range(2)))
            assert len(replies) == 2
    asyncio.run(scenario())


def test_info_counts_against_the_per_client_limit_like_every_call():
    async def scenario():
        async with coordinator_like(max_concurrent=1) as (servicer, channel, _address):
            assert (await stub(channel).Info(generation_pb2.InfoRequest(), timeout=5)).vocab_size == 7
            servicer.release.clear()
            held = asyncio.ensure_future(stub(channel).Generate(generation_pb2.GenerateRequest(text="hi"), timeout=10))
            while servicer.running < 1:
                await asyncio.sleep(0.01)
            error = await status_of(stub(channel).Info(generation_pb2.InfoRequest(), timeout=5))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "at most 1" in error.details()
            servicer.release.set()
            assert (await held).text == "hi"
            assert (await stub(channel).Info(generation_pb2.InfoRequest(), timeout=5)).vocab_size == 7
    asyncio.run(scenario())


def test_with_auth_each_token_is_its_own_client():
    async def scenario():
        async with coordinator_like(BearerAuth((TOKEN_A, TOKEN_B)), max_concurrent=1) as (servicer, channel, _address):
            servicer.release.clear()
            request = generation_pb2.GenerateRequest(text="hi")
            first = asyncio.ensure_future(stub(channel).Generate(request, timeout=10, metadata=AS_A))
            while servicer.running < 1:
                await asyncio.sleep(0.01)
            again = await status_of(stub(channel).Generate(request, timeout=5, metadata=AS_A))
            assert again.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            other = asyncio.ensure_future(stub(channel).Generate(request, timeout=10, metadata=AS_B))
            while servicer.running < 2:
                await asyncio.sleep(0.01)
            servicer.release.set()
            assert (await first).text == (await other).text == "hi"
    asyncio.run(scenario())


@pytest.mark.parametrize("peer,host", [
    ("ipv4:127.0.0.1:51234", "127.0.0.1"),
    ("ipv6:[::1]:51234", "::1"),
    ("ipv6:[2001:db8::7]:443", "2001:db8::7"),
    ("unix:/tmp/sock", "unix:/tmp/sock"),
])
def test_peer_host_drops_the_port(peer, host):
    assert peer_host(peer) == host
