"""What the coordinator believes a draft replica's prefix cache holds: the hint that prices a draft's read."""

from __future__ import annotations

import asyncio

import grpc
from grpc.aio import Metadata

from coordinator.prefix_mirror import PrefixMirror
from coordinator.workers import WorkerClient
from tandem.sampling_params import SamplingParams
from tandem.v1 import common_pb2, draft_pb2

SYSTEM = list(range(100, 140))  # 40 tokens: 10 blocks of 4


def test_a_recorded_prompt_matches_whole_blocks_of_any_prompt_that_starts_like_it():
    mirror = PrefixMirror()
    mirror.record([*SYSTEM, 1, 2], block_size=4, capacity=100)
    assert len(mirror) == 10  # the partial last block is not cached by a worker either
    assert mirror.match([*SYSTEM, 7, 8, 9], block_size=4) == 40
    assert mirror.match(SYSTEM[:38], block_size=4) == 36
    assert mirror.match([0, *SYSTEM[1:]], block_size=4) == 0  # a chain: a changed head changes every block
    assert mirror.match([*SYSTEM[:5], 0, *SYSTEM[6:]], block_size=4) == 4
    mirror.clear()
    assert mirror.match(SYSTEM, block_size=4) == 0


def test_a_full_mirror_forgets_the_least_recently_used_prompt_tail_first():
    mirror = PrefixMirror()
    other = list(range(500, 520))  # 5 blocks
    mirror.record(SYSTEM, block_size=4, capacity=12)
    mirror.record(other, block_size=4, capacity=12)  # 15 blocks: SYSTEM, the older, loses its last 3
    assert len(mirror) == 12
    assert mirror.match(SYSTEM, block_size=4) == 28  # its head survives, so what is left still matches
    assert mirror.match(other, block_size=4) == 20
    mirror.record(list(range(900, 912)), block_size=4, capacity=12)  # 3 new blocks: SYSTEM was used before other
    assert mirror.match(other, block_size=4) == 20 and mirror.match(SYSTEM, block_size=4) == 16


class DraftStub:
    """A draft worker's Info and Propose, as the coordinator's client sees them."""

    def __init__(self, info: common_pb2.WorkerInfo) -> None:
        self.info = info
        self.down = False

    async def Info(self, request, timeout):  # noqa: N802 (gRPC's method names)
        if self.down:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, Metadata(), Metadata(), details="down")
        return self.info

    async def Propose(self, request, timeout, metadata=None):  # noqa: N802
        return draft_pb2.ProposeResponse(tokens=[1] * request.k)


def draft_info(enabled: bool = True, total_blocks: int = 100, generated: bool = False) -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(role="draft", block_size=4, total_blocks=total_blocks,
                                 prefix_cache=common_pb2.PrefixCacheInfo(enabled=enabled, generated=generated))


def test_a_draft_replica_is_believed_to_hold_the_prompts_it_drafted_after():
    async def scenario():
        client = WorkerClient("127.0.0.1:1", "draft", 60.0)
        client.stub = stub = DraftStub(draft_info())
        await client.refresh()
        channel = client.for_request(None)
        question = [*SYSTEM, 1, 2, 3]
        assert channel.cached_prefix(question) == 0
        await channel.propose("a", 0, [*SYSTEM, 7, 8], 0, SamplingParams(), prompt_len=42)
        assert channel.cached_prefix(question) == 0  # k = 0 only records: the draft read nothing
        await channel.propose("a", 0, [*SYSTEM, 7, 8, 9], 3, SamplingParams(), prompt_len=42)
        assert channel.cached_prefix(question) == 40  # drafted after the prompt: its full blocks are cached
        await channel.propose("a", 43, [4, 5, 6, 7, 8], 3, SamplingParams(), prompt_len=42)
        assert channel.cached_prefix([*SYSTEM, 7, 8, 9, 4, 5, 6, 7]) == 40  # never the tokens after the prompt
        assert client.for_request(None).cached_prefix(question) == 40  # a replica's, not one request's

        stub.down = True  # it stops answering: it may come back with an empty cache
        await client.refresh()
        stub.down = False
        await client.refresh()
        assert channel.cached_prefix(question) == 0

        await channel.propose("b", 0, [*SYSTEM, 9], 3, SamplingParams(), prompt_len=41)
        stub.info = draft_info(enabled=False)  # started with --no-prefix-caching
        await client.refresh()
        assert channel.cached_prefix(question) == 0
        await client.close()

    asyncio.run(scenario())


def test_a_draft_that_caches_the_targets_text_is_believed_to_hold_a_finished_requests_verified_text():
    async def scenario():
        client = WorkerClient("127.0.0.1:1", "draft", 60.0)
        client.stub = DraftStub(draft_info(generated=True))
        await client.refresh()
        answer = [4, 5, 6, 7, 8, 9, 10]
        next_turn = [*SYSTEM, 1, 2, *answer, 11, 12]  # the next turn resends the prompt and the answer
        channel = client.for_request(None)
        await channel.propose("a", 0, [*SYSTEM, 1, 2], 3, SamplingParams(), prompt_len=42, verified_len=42)
        await channel.propose("a", 42, answer[:4], 3, SamplingParams(), prompt_len=42, verified_len=46)
        await channel.propose("a", 46, [*answer[4:], 99], 3, SamplingParams(), prompt_len=42, verified_len=49)
        assert channel.cached_prefix(next_turn) == 40  # the prompt's blocks, while the request runs
        await channel.release("a")
        assert channel.cached_prefix(next_turn) == 48  # its 49 verified tokens: 12 blocks, not the guess 99
        client.stub = DraftStub(draft_info())  # a draft that caches prompts only
        await client.refresh()
        other = client.for_request(None)
        await other.propose("b", 0, [*SYSTEM, 3, 3], 3, SamplingParams(), prompt_len=42, verified_len=42)
        await other.propose("b", 42, answer, 3, SamplingParams(), prompt_len=42, verified_len=49)
        await other.release("b")
        assert other.cached_prefix([*SYSTEM, 3, 3, *answer]) == 40
        await client.close()

    asyncio.run(scenario())


def test_the_mirror_holds_no_more_blocks_than_the_replicas_pool():
    async def scenario():
        client = WorkerClient("127.0.0.1:1", "draft", 60.0)
        client.stub = DraftStub(draft_info(total_blocks=6))
        await client.refresh()
        await client.for_request(None).propose("a", 0, [*SYSTEM, 1], 2, SamplingParams(), prompt_len=41)
        assert len(client.prompt_blocks) == 6 and client.cached_prefix(SYSTEM) == 24
        await client.close()

    asyncio.run(scenario())
