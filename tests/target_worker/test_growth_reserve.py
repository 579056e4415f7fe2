"""A target serving coordinators starts a new sequence only while the running ones keep room to grow.

A burst of prompts used to fill the pool with prompts, and every running sequence was refused the round after
(preempted, and computed again). With ``reserve_growth`` (a worker's engine) a new Prefill is refused while the
running sequences' room would be taken: their next two rounds, or the rest of the answer where its Prefill's
``max_len`` says that is less. On a tiny model, through the engine's own batches.
"""

from __future__ import annotations

import pytest

from tandem.config import EngineConfig
from tandem.engine import ModelEngine
from tandem.errors import KVCacheExhaustedError
from tandem.rpc.sequence_engine import GROWTH_ROUNDS
from tandem.sampling import SamplingParams
from tandem.spec.adaptive import IN_FLIGHT_TOKENS
from target_worker.engine import PrefillCall, TargetEngine, VerifyCall
from tests.target_worker.test_engine import ok, one_thread  # noqa: F401 - autouse: one torch thread

GREEDY = SamplingParams()
def prompt(n: int, first: int) -> list[int]:
    """A prompt of ``n`` tokens no other shares (the prefix cache plays no part here)."""
    return list(range(first, first + n))


def target(model_dir, reserve: bool) -> TargetEngine:
    # 23 blocks of 4 tokens
    return TargetEngine(ModelEngine.load(EngineConfig(model_dir, dtype="float32", kv_cache_tokens=92, block_size=4)),
                        reserve_growth=reserve)


@pytest.mark.parametrize("reserve", [False, True])
def test_a_new_prompt_waits_while_the_running_sequence_needs_the_room(tiny_qwen2_dir, reserve):
    engine = target(tiny_qwen2_dir, reserve)
    (first,) = ok(engine.run_batch([PrefillCall("a", prompt(16, 3), GREEDY)]))  # no max_len: two rounds' room
    # a takes 4 blocks; with the reserve it keeps ceil((16 + 32) / 4) - 4 = 8 more free, so of the 19 free
    # blocks a second 16-token prompt (4 blocks, and 8 of its own room) does not fit: 4 + 8 + 8 > 19
    (second,) = engine.run_batch([PrefillCall("b", prompt(16, 40), GREEDY)])
    assert GROWTH_ROUNDS * IN_FLIGHT_TOKENS == 32
    if reserve:
        assert isinstance(second, KVCacheExhaustedError)
        assert not engine.engine.kv_cache.has_sequence("b")  # refused whole: nothing held
    else:
        assert not isinstance(second, BaseException)
    # the running sequence grows either way
    ok(engine.run_batch([VerifyCall("a", 17, [first.next_token] * 3, [])]))


def test_a_sequence_near_its_end_keeps_only_what_it_still_needs(tiny_qwen2_dir):
    """``max_len`` bounds the room: a request of a few new tokens left is not held to two rounds' growth."""
    engine = target(tiny_qwen2_dir, reserve=True)
    ok(engine.run_batch([PrefillCall("a", prompt(16, 3), GREEDY, max_len=20)]))  # 1 more block at most
    # 19 free: b's 4 blocks, a's 1 and b's own 5 (max_len 36) fit
    ok(engine.run_batch([PrefillCall("b", prompt(16, 40), GREEDY, max_len=36)]))
    # 15 free: c's 4 blocks + a's 1 + b's 5 + c's 8 (no max_len: two rounds) do not
    (refused,) = engine.run_batch([PrefillCall("c", prompt(16, 80), GREEDY)])
    assert isinstance(refused, KVCacheExhaustedError) and "needs 3 more blocks" in str(refused)
    (taken,) = engine.run_batch([PrefillCall("c", prompt(8, 80), GREEDY, max_len=8)])  # 2 blocks, no growth: fits
    assert not isinstance(taken, BaseException)
