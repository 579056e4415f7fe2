"""A target holds a Prefill its full KV pool cannot take when the Prefill asks it to (``wait_for_room_s``): the
prompt is admitted in the batch step whose release frees its room, keeping its place against later prompts
meanwhile; asked not to, it is refused at once as before. On a tiny model, through the worker's own batcher."""

from __future__ import annotations

import asyncio
import math

import pytest

from tandem.compute_thread import CallingThreadExecutor
from tandem.errors import InvalidRequestError, KVCacheExhaustedError
from tandem.rpc.batcher import Batcher
from tandem.rpc.room_waits import HOLD_S, room_hold_s
from target_worker.engine import PrefillCall, Prefilled, ReleaseCall
from tests.target_worker.test_engine import one_thread  # noqa: F401 - autouse: one torch thread
from tests.target_worker.test_priority import GREEDY, full_target, grow, prompt, small, urgent


def waiting_prompt(wait_for_room_s: float) -> PrefillCall:
    # 6 blocks and 1 to grow into: 7, where the full target has 5 free
    return PrefillCall("first", prompt(24, 70), GREEDY, max_len=28, arrival_time=100.0,
                       wait_for_room_s=wait_for_room_s)


async def until(condition) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the condition never held")


@pytest.mark.parametrize("wait_for_room_s", [2.0, 0.0])
def test_a_prompt_that_asks_to_wait_for_room_is_admitted_when_a_release_frees_it(tiny_qwen2_dir, wait_for_room_s):
    engine, _, _ = full_target(tiny_qwen2_dir, low=0)
    batches: list[int] = []

    async def scenario():
        batcher = Batcher(engine.run_batch, engine.call_cost, 2048, on_batch=lambda n, t, s: batches.append(n),
                          executor=CallingThreadExecutor(), hold_s=room_hold_s)
        batcher.start()
        try:
            first = asyncio.ensure_future(batcher.submit(waiting_prompt(wait_for_room_s)))
            await until(lambda: batcher.held == 1 or first.done())
            if wait_for_room_s == 0:
                return await asyncio.gather(first, return_exceptions=True)
            # a later prompt that would fit is refused: the held one keeps its place
            (later,) = await asyncio.gather(batcher.submit(small("later", 200.0)), return_exceptions=True)
            assert isinstance(later, KVCacheExhaustedError)
            assert await batcher.submit(ReleaseCall("a")) is True
            return [await first]
        finally:
            await batcher.stop()

    (answer,) = asyncio.run(scenario())
    if wait_for_room_s == 0:
        assert isinstance(answer, KVCacheExhaustedError) and batches == [1]  # refused at once, as before
        return
    assert isinstance(answer, Prefilled)
    assert batches == [1, 2, 2]  # refused; tried beside "later"; admitted beside the release that freed its room
    assert engine.engine.kv_cache.has_sequence("first")
    assert len(engine.room_waits) == 1  # its place forgotten; "later" keeps its own, behind it


def test_a_prompt_asking_in_every_batch_keeps_its_place_in_each_of_them(tiny_qwen2_dir):
    """A held prompt is tried beside every batch, so the place a refusal keeps (for the batches it is not in) must
    hold in the batches it is in too: against lower priorities' growth, and against later prompts of its own."""
    engine, _, (a_first, b_first) = full_target(tiny_qwen2_dir, low=1)
    refused = engine.run_batch([urgent(), grow("a", 40, a_first), grow("b", 32, b_first)])
    assert all(isinstance(r, KVCacheExhaustedError) for r in refused)  # the low ones do not grow into its room
    engine, _, _ = full_target(tiny_qwen2_dir, low=0)
    first, later = engine.run_batch([waiting_prompt(1.0), small("later", 200.0)])
    assert isinstance(first, KVCacheExhaustedError) and isinstance(later, KVCacheExhaustedError)  # later fits, waits


@pytest.mark.parametrize("seconds", [-1.0, math.nan, math.inf])
def test_a_hold_that_is_not_a_number_of_seconds_is_refused_as_a_bad_call(tiny_qwen2_dir, seconds):
    engine, _, _ = full_target(tiny_qwen2_dir, low=0)
    (refused,) = engine.run_batch([waiting_prompt(seconds)])
    assert isinstance(refused, InvalidRequestError) and "wait_for_room_s" in str(refused)


def test_only_a_refusal_for_room_is_held_and_at_most_as_long_as_places_are_kept():
    full = KVCacheExhaustedError("KV cache full")
    assert room_hold_s(waiting_prompt(2.0), full) == 2.0
    assert room_hold_s(waiting_prompt(600.0), full) == HOLD_S  # the places it named last that long
    assert room_hold_s(waiting_prompt(0.0), full) == 0.0
    assert room_hold_s(waiting_prompt(2.0), InvalidRequestError("bad")) == 0.0
    assert room_hold_s(ReleaseCall("a"), full) == 0.0  # (a call that cannot ask)
