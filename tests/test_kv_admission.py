"""In process, more requests than the KV pools hold at once: they start as room frees, none is refused.

Before ``tandem.kv_admission``, ``SpeculativeGenerator.generate`` given 70 requests on a 64-block pool had
the 65th Prefill refused (``KVCacheExhaustedError``), and then hung: the other requests' releases waited
on batchers already stopped.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine import ModelEngine
from tandem.errors import InvalidRequestError
from tandem.inprocess import GenerationRequest, LocalTarget, SpeculativeGenerator
from tandem.kv_admission import KVAdmission
from tandem.kv_cache import PagedKVCache
from tandem.sampling_params import SamplingParams
from tandem.spec.adaptive import IN_FLIGHT_TOKENS
from tandem.spec.options import SpecOptions


def pool(blocks: int, block_size: int = 16) -> PagedKVCache:
    return PagedKVCache(num_layers=1, num_blocks=blocks, block_size=block_size, num_kv_heads=1, head_dim=2,
                        dtype=torch.float32)


def test_reservations_start_in_order_as_room_frees_and_a_cancelled_wait_leaves_the_queue():
    async def scenario():
        admission = KVAdmission([pool(4), pool(8, block_size=8)])
        assert admission.blocks_for(10, 6) == [-(-(16 + IN_FLIGHT_TOKENS) // 16), -(-(16 + IN_FLIGHT_TOKENS) // 8)]
        assert admission.blocks_for(10_000, 1) == [4, 8]  # longer than a pool: all of it, never more
        started: list[str] = []
        release = {name: asyncio.Event() for name in "abcd"}

        async def request(name: str, prompt: int) -> None:
            async with admission.hold(prompt, 0):
                started.append(name)
                await release[name].wait()

        a = asyncio.ensure_future(request("a", 30))  # 46 tokens: 3 of 4 blocks, 6 of 8: [1, 2] left
        b = asyncio.ensure_future(request("b", 30))  # does not fit beside a: waits
        c = asyncio.ensure_future(request("c", 0))  # 16 tokens: fits beside a, but b came first
        await asyncio.sleep(0.01)
        assert started == ["a"]
        b.cancel()  # b gives up waiting: c is next in line and fits beside a
        await asyncio.sleep(0.01)
        assert started == ["a", "c"]
        release["a"].set(), release["c"].set()
        await asyncio.gather(a, c)
        d = asyncio.ensure_future(request("d", 30))
        await asyncio.sleep(0.01)
        assert started == ["a", "c", "d"]  # everything given back
        release["d"].set()
        await d

    asyncio.run(scenario())


def small_pool_engine(model_dir, kv_tokens: int = 1024) -> ModelEngine:
    return ModelEngine.load(EngineConfig(model_dir, dtype="float32", kv_cache_tokens=kv_tokens))


def test_more_requests_than_the_pool_holds_all_finish_with_their_own_output(tiny_qwen2_dir):
    target, draft = small_pool_engine(tiny_qwen2_dir), small_pool_engine(tiny_qwen2_dir)
    assert target.kv_cache.num_blocks == 64
    prompts = [[3 + i % 7, 5, 9 + i % 5, 2] for i in range(70)]  # 70 requests of one block each
    requests = [GenerationRequest(p, 6) for p in prompts]
    alone = {tuple(p): SpeculativeGenerator(small_pool_engine(tiny_qwen2_dir)).generate([GenerationRequest(p, 6)])[0]
             .token_ids for p in {tuple(p) for p in prompts}}
    results = SpeculativeGenerator(target, draft, SpecOptions("draft", 3, adaptive_k=False)).generate(requests)
    assert [r.token_ids for r in results] == [alone[tuple(p)] for p in prompts]
    assert all(r.stats.preemptions == 0 for r in results)
    assert target.kv_cache.num_free_blocks == 64 and draft.kv_cache.num_free_blocks == 64  # all released


def test_a_failing_request_fails_the_call_instead_of_hanging_it(tiny_qwen2_dir, monkeypatch):
    prefill = LocalTarget.prefill

    async def failing(self, seq_id, token_ids, sampling, prompt_len=0, propose=0):
        if token_ids[0] == 13:
            raise RuntimeError("a broken request")
        return await prefill(self, seq_id, token_ids, sampling, prompt_len, propose)

    monkeypatch.setattr(LocalTarget, "prefill", failing)
    requests = [GenerationRequest([3, 5, 7], 40, SamplingParams()) for _ in range(4)] + [GenerationRequest([13, 5], 4)]
    outcome: list[BaseException] = []
    engines: list[ModelEngine] = []

    def call() -> None:  # (on a thread of its own, so that a hang fails the test instead of stalling it)
        engines.append(small_pool_engine(tiny_qwen2_dir))  # built on the thread that computes with it
        try:
            SpeculativeGenerator(engines[0], None, SpecOptions("ngram", 3)).generate(requests)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "generate() hung after a request failed"
    assert len(outcome) == 1 and "a broken request" in str(outcome[0])
    cache = engines[0].kv_cache
    assert cache.num_free_blocks == cache.num_blocks  # the others released their KV


@pytest.mark.parametrize("requests", [0, 1])
def test_an_empty_or_single_call_runs_as_before(tiny_qwen2_dir, requests):
    target = small_pool_engine(tiny_qwen2_dir)
    results = SpeculativeGenerator(target).generate([GenerationRequest([3, 5, 7], 4)] * requests)
    assert len(results) == requests and all(len(r.token_ids) == 4 for r in results)


def test_a_request_longer_than_a_pool_holds_is_refused_before_anything_runs(tiny_qwen2_dir):
    """Admitted alone (it reserves the whole pool), it ran until the pool ran out and failed then."""
    target = small_pool_engine(tiny_qwen2_dir, kv_tokens=256)  # (the model's context: 512)
    room = target.kv_cache.num_blocks * target.kv_cache.block_size - IN_FLIGHT_TOKENS
    generator = SpeculativeGenerator(target)
    with pytest.raises(InvalidRequestError, match=rf"prompt \(4 tokens\) \+ max_new_tokens \({room - 3}\) is more "
                                                   rf"than the target's KV cache holds for one sequence \({room} "):
        generator.generate([GenerationRequest([3, 5, 9, 2], 2), GenerationRequest([3, 5, 9, 2], room - 3)])
    assert target.kv_cache.num_free_blocks == target.kv_cache.num_blocks  # nothing ran
    assert len(generator.generate([GenerationRequest([3, 5, 9, 2], room - 4)])[0].token_ids) <= room - 4  # fits
