"""Calls refused for room, held by the batcher: tried again beside every later batch and admitted in the step that
frees their room, never a batch of their own, answered with their refusal once their time is up (tandem/rpc/batcher.py).

The model here is a pool of slots: a call ``("take", name)`` needs one, ``("free", name)`` gives its slot back first
(as a worker applies a batch's releases before it admits), and a call with no free slot is refused as a full KV pool
refuses it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from tandem.config import ServerOptions
from tandem.errors import KVCacheExhaustedError
from tandem.rpc.batcher import Batcher
from tandem.rpc.server import ManagedServer

Call = tuple[str, str]


class Slots:
    def __init__(self, free: int) -> None:
        self.free = free
        self.batches: list[list[Call]] = []

    def run_batch(self, calls: list[Call]) -> list[object]:
        self.batches.append(list(calls))
        results: list[object] = [None] * len(calls)
        for i, (op, name) in enumerate(calls):
            if op == "free":
                self.free += 1
                results[i] = f"freed {name}"
        for i, (op, name) in enumerate(calls):
            if op == "take":
                if self.free:
                    self.free -= 1
                    results[i] = f"took {name}"
                else:
                    results[i] = KVCacheExhaustedError(f"KV cache full: sequence {name!r} needs 1 more block")
        return results


def held_for(seconds: float):
    """``hold_s`` as a worker's: calls refused for room wait ``seconds``; any other error is answered at once."""
    return lambda call, error: seconds if isinstance(error, KVCacheExhaustedError) else 0.0


@asynccontextmanager
async def batching(slots: Slots, hold_s: float, cost=lambda call: 1) -> AsyncIterator[Batcher]:
    """A running batcher over ``slots`` whose refusals for room are held ``hold_s``; stopped on leaving."""
    batcher = Batcher(slots.run_batch, cost=cost, token_budget=10, hold_s=held_for(hold_s))
    batcher.start()
    try:
        yield batcher
    finally:
        await batcher.stop()


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.005)


async def refused_and_held(batcher: Batcher, name: str) -> asyncio.Future:
    """``("take", name)`` submitted, once it has been refused and is held."""
    held = batcher.held
    call = asyncio.ensure_future(batcher.submit(("take", name)))
    await until(lambda: batcher.held == held + 1)
    return call


def test_a_call_refused_for_room_is_held_and_admitted_in_the_step_that_frees_it():
    slots = Slots(free=0)

    async def scenario():
        async with batching(slots, 30.0) as batcher:
            waiting = await refused_and_held(batcher, "b")
            await asyncio.sleep(0.1)  # held alone, it runs no batch of its own (nothing else could free room)
            assert len(slots.batches) == 1 and not waiting.done()
            assert batcher.queue_depth == 1  # counted among the calls waiting
            assert await batcher.submit(("free", "a")) == "freed a"
            return await waiting

    assert asyncio.run(scenario()) == "took b"
    assert slots.batches == [[("take", "b")], [("free", "a"), ("take", "b")]]  # admitted beside the release


def test_without_a_hold_a_refusal_is_answered_at_once():
    slots = Slots(free=0)

    async def scenario():
        async with batching(slots, 0.0) as batcher:
            return await asyncio.gather(batcher.submit(("take", "b")), return_exceptions=True)

    (refused,) = asyncio.run(scenario())
    assert isinstance(refused, KVCacheExhaustedError)


def test_a_held_call_gets_its_last_refusal_once_its_time_is_up():
    slots = Slots(free=0)

    async def scenario():
        async with batching(slots, 0.3) as batcher:
            loop = asyncio.get_running_loop()
            asked = loop.time()
            with pytest.raises(KVCacheExhaustedError, match="'b' needs 1 more block"):
                await batcher.submit(("take", "b"))
            assert loop.time() - asked >= 0.3  # held, not answered at once
            assert batcher.held == 0

    asyncio.run(scenario())
    assert slots.batches == [[("take", "b")]]  # tried once: no batch ran since


def test_held_calls_are_tried_again_beside_later_batches_oldest_first():
    slots = Slots(free=0)

    async def scenario():
        async with batching(slots, 30.0) as batcher:
            first = await refused_and_held(batcher, "first")
            second = await refused_and_held(batcher, "second")
            await batcher.submit(("free", "x"))  # room for one: the one held longest
            assert await first == "took first" and not second.done()
            await batcher.submit(("free", "y"))
            assert await second == "took second"

    asyncio.run(scenario())
    assert slots.batches[2] == [("free", "x"), ("take", "first"), ("take", "second")]


def test_held_calls_join_a_batch_within_its_budget_and_the_oldest_always():
    slots = Slots(free=0)

    async def scenario():
        async with batching(slots, 30.0, cost=lambda c: 3 if c[0] == "take" else 8) as batcher:
            held = [await refused_and_held(batcher, name) for name in ("p", "q")]
            await batcher.submit(("free", "x"))  # 8 of 10: the oldest held call joins anyway, the other waits
            assert await held[0] == "took p"
            assert batcher.held == 1
            await batcher.submit(("free", "y"))
            assert await held[1] == "took q"

    asyncio.run(scenario())
    assert slots.batches[2] == [("free", "x"), ("take", "p")]


def test_a_held_call_whose_caller_gave_up_is_dropped():
    slots = Slots(free=0)

    async def scenario():
        async with batching(slots, 30.0) as batcher:
            gone = await refused_and_held(batcher, "gone")
            gone.cancel()  # its client's deadline passed, or its coordinator cancelled the RPC
            await batcher.submit(("free", "x"))

    asyncio.run(scenario())
    assert slots.batches[-1] == [("free", "x")] and slots.free == 1  # nobody took the room for it


def test_a_stopping_batcher_answers_its_held_calls_with_their_refusal():
    slots = Slots(free=0)

    async def scenario():
        batcher = Batcher(slots.run_batch, cost=lambda c: 1, token_budget=10, hold_s=held_for(30.0))
        batcher.start()
        waiting = await refused_and_held(batcher, "b")
        await batcher.stop()  # its coordinator may ask another replica at once
        return await asyncio.gather(waiting, return_exceptions=True)

    (answer,) = asyncio.run(scenario())
    assert isinstance(answer, KVCacheExhaustedError)


def test_a_draining_worker_answers_its_held_calls_at_once_and_takes_no_more():
    """Draining, a worker takes no new sequence: its held calls get their refusal as the drain starts (not after
    their hold), so that their coordinators ask a replica that stays; the drain then waits for nothing held."""
    slots = Slots(free=0)

    async def scenario():
        server = ManagedServer("target", ServerOptions(host="127.0.0.1", port=0))
        await server.start()
        async with batching(slots, 30.0) as batcher:
            server.on_drain.append(batcher.refuse_held)
            waiting = await refused_and_held(batcher, "b")
            await server.drain_and_stop()
            assert waiting.done() and batcher.held == 0
            return await asyncio.gather(waiting, return_exceptions=True)

    (answer,) = asyncio.run(scenario())
    assert isinstance(answer, KVCacheExhaustedError)


def test_a_held_call_that_fails_for_another_reason_on_a_later_try_is_answered_at_once():
    slots = Slots(free=0)
    run_batch = slots.run_batch

    def failing_later(calls):  # once held, "b"'s next try fails as a bad call does
        results = run_batch(calls)
        return [ValueError("bad call") if call == ("take", "b") and len(slots.batches) > 1 else result
                for call, result in zip(calls, results)]

    slots.run_batch = failing_later

    async def scenario():
        async with batching(slots, 30.0) as batcher:
            waiting = await refused_and_held(batcher, "b")
            await batcher.submit(("free", "x"))
            # answered by the batch that tried it, not held on until its time is up (30 s)
            return await asyncio.gather(asyncio.wait_for(waiting, 5.0), return_exceptions=True)

    (answer,) = asyncio.run(scenario())
    assert isinstance(answer, ValueError)
