"""A fleet of target replicas with unequal KV pools (a rolling change of --kv-cache-tokens, two kinds of GPU): a
request that only the larger ones hold goes there. The smallest pool bounded every request before, so one small
replica made the whole fleet refuse what its other replicas could serve."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from tandem.rpc.tls import open_channel
from tandem.tokenizer import tokenizer_fingerprint
from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.coordinator.inprocess import MAX_CONTEXT, TOKEN, Coordinator, fake_target, tiny_tokenizer

# 16-token blocks, a round in flight holding 16: the small pool takes sequences of 32 tokens, the large one of 48
SMALL_BLOCKS, LARGE_BLOCKS = 3, 4


def request(prompt_len: int, max_new: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[3] * prompt_len),
                                          stopping=generation_pb2.StoppingOptions(max_new_tokens=max_new))


def test_a_request_only_the_larger_target_holds_is_served_there_and_one_past_it_is_refused(tmp_path):
    tokenizer = tiny_tokenizer(tmp_path)
    fingerprint = tokenizer_fingerprint(tokenizer)

    async def scenario():
        coordinator = Coordinator(tokenizer)
        await coordinator.server.start()
        try:
            async with contextlib.AsyncExitStack() as stack:
                small, _, small_address = await stack.enter_async_context(fake_target(fingerprint))
                large, _, large_address = await stack.enter_async_context(fake_target(fingerprint))
                small.total_blocks, large.total_blocks = SMALL_BLOCKS, LARGE_BLOCKS
                channel = await stack.enter_async_context(open_channel(coordinator.address, None, aio=True))
                await coordinator.warm_up(small_address)
                coordinator.targets.update({small_address, large_address})
                while not all(c.healthy for c in coordinator.targets.clients):
                    await asyncio.sleep(0.01)
                stub = generation_pb2_grpc.GenerationStub(channel)

                info = await stub.Info(generation_pb2.InfoRequest(), timeout=5)
                assert info.max_context == 48 < MAX_CONTEXT  # what the largest pool holds: what clients size by
                for _ in range(3):  # 45 tokens: past the small pool's 32, within the large one's 48
                    reply = await stub.Generate(request(20, 25), timeout=10)
                    assert list(reply.token_ids) == [TOKEN] * 25
                assert (small.calls["Prefill"], large.calls["Prefill"]) == (0, 3)
                with pytest.raises(grpc.aio.AioRpcError) as refused:  # 50 tokens: more than any replica holds
                    await stub.Generate(request(20, 30), timeout=10)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert ("maximum context length is 48 tokens here (what a target worker's KV cache holds for one "
                        "sequence") in refused.value.details()
                for _ in range(4):  # short requests go to either
                    assert len((await stub.Generate(request(3, 2), timeout=10)).token_ids) == 2
                assert small.calls["Prefill"] + large.calls["Prefill"] == 3 + 4
        finally:
            await coordinator.close()
    asyncio.run(scenario())
