"""The coordinator's queue of requests waiting for room in a full target pool (tandem/spec/room_queue.py), alone
and under the failover wrapper: requests get room in the order they started (by priority first), whatever their
backoffs, and one that leaves (admitted, given up, cancelled) hands its turn on at once."""

from __future__ import annotations

import asyncio

from tandem.errors import KVCacheExhaustedError
from tandem.sampling_params import SamplingParams
from tandem.spec import failover
from tandem.spec.failover import FailoverVerifier
from tandem.spec.request import RequestState, StopConditions
from tandem.spec.room_queue import RoomQueue
from tandem.spec.transport import FittedCost, Prefilled
from tests.spec.test_loop_faults import Replicas


def test_turns_go_by_priority_then_age_and_each_leaver_hands_on_at_once():
    async def go():
        queue, order = RoomQueue(), []
        turns = {name: queue.join(key) for name, key in
                 (("late", (0, 3.0)), ("early", (0, 1.0)), ("urgent", (-1, 9.0)), ("middle", (0, 2.0)))}
        assert queue.ahead_of((0, 0.5)) and not queue.ahead_of((-2, 0.0))  # an urgent newcomer asks at once

        async def ask(name):
            try:
                await queue.wait_turn(turns[name], 60.0)  # the first: until room may have freed
                order.append(name)
            finally:
                queue.leave(turns[name])
        tasks = [asyncio.create_task(ask(name)) for name in turns]
        await asyncio.sleep(0.05)
        assert order == [] and len(queue) == 4  # nobody asks while no room freed
        queue.room_freed()
        await asyncio.sleep(0.05)
        assert order == ["urgent", "early", "middle", "late"]  # each admitted one hands on to the next at once
        await asyncio.gather(*tasks)
        assert len(queue) == 0
    asyncio.run(go())


def test_a_cancelled_first_hands_its_turn_on_and_the_first_s_pause_ends_when_room_frees():
    async def go():
        queue = RoomQueue()
        first, second = queue.join((0, 1.0)), queue.join((0, 2.0))

        async def ask(turn, pause_s):
            try:
                await queue.wait_turn(turn, pause_s)
            finally:
                queue.leave(turn)
        gone = asyncio.create_task(ask(first, 60.0))
        waiting = asyncio.create_task(ask(second, 60.0))
        await asyncio.sleep(0.02)
        gone.cancel()  # its client went away
        await asyncio.sleep(0.02)
        assert waiting.done() and len(queue) == 0  # the second's turn came at once
        paused = queue.join((0, 3.0))
        started = asyncio.get_running_loop().time()
        await queue.wait_turn(paused, 0.05)  # alone and first: after its pause
        assert asyncio.get_running_loop().time() - started >= 0.04
        waiter = asyncio.create_task(queue.wait_turn(paused, 60.0))
        await asyncio.sleep(0.01)
        queue.room_freed()
        await asyncio.wait_for(waiter, 1.0)  # and at once when room may have freed
    asyncio.run(go())


class OneSlotTarget:
    """A target whose pool holds ``slots`` sequences: a Prefill beyond them is refused as a full pool refuses it."""

    def __init__(self, slots: int) -> None:
        self.free = slots
        self.admitted: list[str] = []
        self.streams = 1

    def fitted_cost(self) -> FittedCost:
        return FittedCost(0.1, 0.001)

    async def prefill(self, seq_id, token_ids, sampling, prompt_len=0, propose=0, wait_for_room_s=0.0):
        if self.free <= 0:
            raise KVCacheExhaustedError(f"KV cache full: sequence {seq_id!r} needs 1 more blocks than are free")
        self.free -= 1
        self.admitted.append(seq_id)
        return Prefilled(9)

    async def release(self, seq_id):
        self.free += 1


def test_requests_refused_for_room_are_admitted_in_the_order_they_started(monkeypatch):
    """The oldest request has backed off longest: alone, it would ask again last and a newer one would take the
    room (without the queue, the second was admitted first); in the queue it asks first."""
    monkeypatch.setattr(failover, "KV_BACKOFF_S", 0.01)
    target = OneSlotTarget(slots=0)
    queue = RoomQueue()

    async def request(name: str, start_s: float) -> None:
        await asyncio.sleep(start_s)
        state = RequestState([1, 2, 3], SamplingParams(), StopConditions(8))
        wrapped = FailoverVerifier(target, Replicas(targets=[target] * 1000), state, lambda _: 0, room=queue,
                                   queue_key=(0, state.stats.started_at))
        await wrapped.prefill(name, [1, 2, 3], state.sampling)

    async def go():
        tasks = [asyncio.create_task(request(name, start)) for name, start in
                 (("first", 0.0), ("second", 0.3), ("third", 0.32))]
        await asyncio.sleep(0.35)  # the first has backed off to about 0.3 s, the others ask every few ms
        for _ in range(3):
            await target.release("someone")  # a running sequence ends: room for one
            queue.room_freed()  # (the coordinator's release callback)
            await asyncio.sleep(0.1)
        await asyncio.gather(*tasks)
        assert len(queue) == 0
    asyncio.run(go())
    assert target.admitted == ["first", "second", "third"]
