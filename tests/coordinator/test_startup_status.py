"""While a server starts (the coordinator waiting for its first target, a worker loading), its calls are
UNAVAILABLE saying so, which clients retry; never a verdict on the request made with limits not yet known."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tandem.rpc.tls import open_channel
from tandem.tokenizer import tokenizer_fingerprint
from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.coordinator.inprocess import TOKEN, Coordinator, fake_target, tiny_tokenizer
from tests.serving import health_status


async def refusal(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


def test_a_request_while_the_coordinator_starts_is_unavailable_saying_so_and_served_once_warm(tmp_path):
    tokenizer = tiny_tokenizer(tmp_path)

    async def scenario():
        coordinator = Coordinator(tokenizer)
        await coordinator.server.start()  # listening; the warm-up has not found a target yet
        try:
            async with open_channel(coordinator.address, None, aio=True) as channel, \
                    fake_target(tokenizer_fingerprint(tokenizer)) as (_, _, target_address):
                stub = generation_pb2_grpc.GenerationStub(channel)
                good = [generation_pb2.GenerateRequest(text="ab", stopping=generation_pb2.StoppingOptions(
                            max_new_tokens=1)),
                        generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[3, 4]))]
                for request in good:
                    for call in (stub.Generate(request, timeout=5), stub.GenerateStream(request, timeout=5).read()):
                        error = await refusal(call)
                        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                        assert "coordinator is starting" in error.details(), error.details()
                info = await refusal(stub.Info(generation_pb2.InfoRequest(), timeout=5))
                assert info.code() == grpc.StatusCode.UNAVAILABLE
                assert await health_status(coordinator.address) == health_pb2.HealthCheckResponse.NOT_SERVING

                await coordinator.warm_up(target_address)
                reply = await stub.Generate(good[0], timeout=5)
                assert list(reply.token_ids) == [TOKEN]
                assert (await stub.Info(generation_pb2.InfoRequest(), timeout=5)).max_context > 0
        finally:
            await coordinator.close()
    asyncio.run(scenario())


def test_a_worker_still_warming_up_is_starting_to_the_coordinator_not_routed_to(tmp_path):
    tokenizer = tiny_tokenizer(tmp_path)

    async def scenario():
        coordinator = Coordinator(tokenizer)
        try:
            async with fake_target(tokenizer_fingerprint(tokenizer), serve=False) as (worker, server, address):
                coordinator.targets.update({address})
                await coordinator.targets.refresh_all()
                assert [c.state for c in coordinator.targets.clients] == ["starting"]
                assert not coordinator.targets.has_routable()
                await server.set_serving()
                await coordinator.targets.refresh_all()
                assert [c.state for c in coordinator.targets.clients] == ["healthy"]
                assert worker.calls["Info"] == 1  # the refused ones never reached the servicer
        finally:
            await coordinator.close()
    asyncio.run(scenario())
