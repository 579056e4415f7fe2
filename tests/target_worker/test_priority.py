"""Priorities in a target's KV pool: a prompt of a higher priority (lower value) starts ahead of the growth of lower
ones, and when the pool is full it keeps its place: the lower ones are refused as they grow (their coordinators
preempt them) until it fits. On a tiny model, through the engine's own batches; equal priorities are FCFS as before.
"""

from __future__ import annotations

import pytest

from tandem.config import EngineConfig
from tandem.engine import ModelEngine
from tandem.errors import KVCacheExhaustedError
from tandem.rpc.coordinator_clocks import CoordinatorClocks
from tandem.rpc.room_waits import HOLD_S, QueuedPrompt, RoomWaits
from tandem.sampling import SamplingParams
from target_worker.engine import PrefillCall, ReleaseCall, TargetEngine, VerifyCall
from tests.target_worker.test_engine import ok, one_thread  # noqa: F401 - autouse: one torch thread

GREEDY = SamplingParams()


def prompt(n: int, first: int) -> list[int]:
    """A prompt of ``n`` tokens no other shares (the prefix cache plays no part here)."""
    return list(range(first, first + n))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def full_target(model_dir, low: int) -> tuple[TargetEngine, Clock, list]:
    """23 blocks of 4 tokens, 18 held by two sequences of priority ``low`` (each keeping 2 blocks to grow into):
    5 free. Returns the engine, its clock, and the two sequences' first tokens."""
    engine = TargetEngine(ModelEngine.load(EngineConfig(model_dir, dtype="float32", kv_cache_tokens=92, block_size=4)),
                          reserve_growth=True)
    clock = Clock()
    engine.room_waits = RoomWaits(clock)
    firsts = ok(engine.run_batch([PrefillCall("a", prompt(40, 3), GREEDY, max_len=48, priority=low)]))
    firsts += ok(engine.run_batch([PrefillCall("b", prompt(32, 50), GREEDY, max_len=40, priority=low)]))
    assert engine.engine.kv_cache.num_free_blocks == 5
    return engine, clock, firsts


def urgent() -> PrefillCall:
    # 6 blocks and 1 to grow into (max_len 28): 7, where 5 are free
    return PrefillCall("urgent", prompt(24, 70), GREEDY, max_len=28, priority=0)


def grow(name: str, length: int, first) -> VerifyCall:
    """The sequence's next round: its first token and three drafts, past its full last block (one block more)."""
    return VerifyCall(name, length + 1, [first.next_token] * 3, [])


def test_a_higher_priority_prompt_starts_ahead_of_the_room_kept_for_lower_ones(tiny_qwen2_dir):
    """The room the running sequences keep to grow is theirs against prompts of their priority or lower only."""
    engine = TargetEngine(ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype="float32", kv_cache_tokens=92,
                                                        block_size=4)), reserve_growth=True)
    # a and b each hold 4 blocks and keep 6 (24 more tokens) free to grow into: 11 free
    ok(engine.run_batch([PrefillCall("a", prompt(16, 3), GREEDY, max_len=40, priority=1)]))
    ok(engine.run_batch([PrefillCall("b", prompt(16, 40), GREEDY, max_len=40, priority=1)]))
    # a prompt of their priority: 4 blocks + their 12 + 2 of its own do not fit in 11
    (same,) = engine.run_batch([PrefillCall("c", prompt(16, 80), GREEDY, max_len=24, priority=1)])
    assert isinstance(same, KVCacheExhaustedError)
    # a higher one keeps only its own room free: 4 + 2 fit
    ok(engine.run_batch([PrefillCall("d", prompt(16, 80), GREEDY, max_len=24, priority=0)]))


def test_a_refused_higher_priority_prompt_keeps_its_place_until_it_fits(tiny_qwen2_dir):
    engine, _, (a_first, b_first) = full_target(tiny_qwen2_dir, low=1)
    (refused,) = engine.run_batch([urgent()])
    assert isinstance(refused, KVCacheExhaustedError)
    assert len(engine.room_waits) == 1  # it keeps its place...
    # ...so a lower sequence that grows is refused (its coordinator preempts it), where before it took the room
    a_round, b_round = engine.run_batch([grow("a", 40, a_first), grow("b", 32, b_first)])
    assert isinstance(a_round, KVCacheExhaustedError) and isinstance(b_round, KVCacheExhaustedError)
    ok(engine.run_batch([ReleaseCall("a")]))  # the preemption: a's KV freed (it comes back later, rebuilt)
    ok(engine.run_batch([urgent()]))  # the prompt's next try fits
    assert len(engine.room_waits) == 0
    ok(engine.run_batch([grow("b", 32, b_first)]))  # and b grows again: nobody waits now


def small(name: str, arrival_time: float) -> PrefillCall:
    # 3 blocks and 1 to grow into: fits in the 5 free
    return PrefillCall(name, prompt(12, 60 + len(name)), GREEDY, max_len=16, arrival_time=arrival_time)


def test_a_refused_prompt_goes_before_the_prompts_that_arrived_after_it_and_never_before_what_runs(tiny_qwen2_dir):
    """All at one priority, from several coordinators (each says when its request arrived): a refused prompt keeps
    its place against later prompts, which used to take the room it waited for; an earlier prompt still goes first,
    the running sequences still grow, and a release (its coordinator gave it up or moved it) frees its place."""
    engine, _, (a_first, b_first) = full_target(tiny_qwen2_dir, low=0)
    (refused,) = engine.run_batch([PrefillCall("first", prompt(24, 70), GREEDY, max_len=28, arrival_time=100.0)])
    assert isinstance(refused, KVCacheExhaustedError) and len(engine.room_waits) == 1
    (later,) = engine.run_batch([small("later", 200.0)])
    assert isinstance(later, KVCacheExhaustedError)  # it would fit, but "first" came before it
    ok(engine.run_batch([grow("a", 40, a_first), grow("b", 32, b_first)]))  # what runs goes on
    ok(engine.run_batch([ReleaseCall("a")]))
    ok(engine.run_batch([small("earlier", 50.0)]))  # came before "first": not held back
    (later,) = engine.run_batch([small("later", 200.0)])
    assert isinstance(later, KVCacheExhaustedError) and len(engine.room_waits) == 2  # "later" waits too, behind
    ok(engine.run_batch([ReleaseCall("earlier"), ReleaseCall("first")]))  # "first" is given up here
    assert len(engine.room_waits) == 1  # and its place with it
    ok(engine.run_batch([small("later", 200.0)]))
    assert len(engine.room_waits) == 0


@pytest.mark.parametrize("heard", [True, False])
def test_arrivals_are_compared_on_the_targets_clock_whatever_each_coordinators_says(tiny_qwen2_dir, heard):
    """Coordinator "b"'s clock runs 100 s behind "a"'s (and the target's): its prompt that says 50 arrived at 150,
    after "a"'s waiting prompt of 100, once the target has heard b's Info polls; before, it would go first."""
    engine, _, _ = full_target(tiny_qwen2_dir, low=0)
    engine.room_waits.clocks = CoordinatorClocks(wall_clock=lambda: 1000.0)
    engine.room_waits.clocks.heard("a", 1000.0)
    if heard:
        engine.room_waits.clocks.heard("b", 900.0)
        engine.room_waits.clocks.heard("b", 850.0)  # a poll delayed 50 s on its way: the smallest offset is kept
    first = PrefillCall("first", prompt(40, 10), GREEDY, owner="a", max_len=44, arrival_time=100.0)
    assert isinstance(engine.run_batch([first])[0], KVCacheExhaustedError)  # 11 blocks where 5 are free
    ok(engine.run_batch([ReleaseCall("b")]))  # 13 free: room for "first" or for a small prompt, not for both
    later = small("later", 50.0)
    later.owner = "b"
    (result,) = engine.run_batch([later])
    assert isinstance(result, KVCacheExhaustedError) == heard


def test_a_coordinators_clock_is_its_smallest_recent_offset_and_old_coordinators_are_dropped():
    now = [1000.0]
    clocks = CoordinatorClocks(wall_clock=lambda: now[0])
    assert clocks.on_this_clock("unheard", 5.0) == 5.0
    for delay in (0.3, 0.001, 2.0):
        clocks.heard("c", now[0] - 40.0 - delay)  # c's clock runs 40 s behind; each poll took ``delay`` to arrive
    assert clocks.on_this_clock("c", 10.0) == pytest.approx(50.001)
    for _ in range(CoordinatorClocks.SAMPLES):
        clocks.heard("c", now[0] - 40.5)  # the fast poll has left the window
    assert clocks.on_this_clock("c", 10.0) == pytest.approx(50.5)
    for i in range(CoordinatorClocks.MAX_OWNERS):
        clocks.heard(f"restart-{i}", now[0])
    assert clocks.on_this_clock("c", 10.0) == 10.0  # the least recently heard went first


@pytest.mark.parametrize("told", [True, False])
def test_the_requests_queued_behind_a_prompt_keep_their_places_too(tiny_qwen2_dir, told):
    """Only the first of a coordinator's waiting requests asks; its Prefill tells of those behind it (``queued``), and
    they keep their places against later prompts as it does. Not told of them, the target lets a later prompt take
    the room they wait for."""
    engine, _, _ = full_target(tiny_qwen2_dir, low=0)
    behind = QueuedPrompt("behind", 150.0, tokens=20, max_len=24, priority=0)  # 6 blocks
    head = PrefillCall("head", prompt(24, 70), GREEDY, max_len=28, arrival_time=100.0, queued=(behind,) if told else ())
    (refused,) = engine.run_batch([head])
    assert isinstance(refused, KVCacheExhaustedError) and len(engine.room_waits) == (2 if told else 1)
    ok(engine.run_batch([ReleaseCall("b")]))  # room for the head and 6 blocks more
    (later,) = engine.run_batch([small("later", 200.0)])
    assert isinstance(later, KVCacheExhaustedError) == told
    if told:
        ok(engine.run_batch([head]))  # the head's next try fits: the queue moves on
        assert len(engine.room_waits) == 2  # "behind" still waits (and "later" behind it)


def test_equal_priorities_are_first_come_first_served(tiny_qwen2_dir):
    """All at 0 (FCFS) and saying no arrival (a draft's calls): a refused prompt keeps no place; the running
    sequences grow into the free blocks."""
    engine, _, (a_first, b_first) = full_target(tiny_qwen2_dir, low=0)
    (refused,) = engine.run_batch([urgent()])
    assert isinstance(refused, KVCacheExhaustedError)
    assert len(engine.room_waits) == 0
    ok(engine.run_batch([grow("a", 40, a_first), grow("b", 32, b_first)]))


@pytest.mark.parametrize("ask_again", [False, True])
def test_a_waiting_prompt_that_stops_asking_is_forgotten(tiny_qwen2_dir, ask_again):
    """A prompt that gave up (cancelled, or placed on another replica) holds nothing for longer than ``HOLD_S``; one
    that asks again within it keeps its place."""
    engine, clock, (a_first, _) = full_target(tiny_qwen2_dir, low=1)
    engine.run_batch([urgent()])
    clock.now += HOLD_S * 0.9
    if ask_again:
        (refused,) = engine.run_batch([urgent()])  # refused again: its place is kept from now
        assert isinstance(refused, KVCacheExhaustedError)
    clock.now += HOLD_S * 0.2
    (grown,) = engine.run_batch([grow("a", 40, a_first)])
    assert isinstance(grown, KVCacheExhaustedError) == ask_again
