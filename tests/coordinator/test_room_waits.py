"""Requests waiting for room in a target's KV pool are woken first come, first served, as room is released."""

from __future__ import annotations

import asyncio

from coordinator.room_waits import RoomWaits


def test_a_release_wakes_the_earliest_waiters_its_room_could_hold_and_a_refused_one_keeps_its_place():
    async def scenario():
        waits = RoomWaits()
        woken: list[str] = []

        async def wait(name: str, since: float, tokens: int, timeout_s: float = 5.0) -> None:
            await waits.wait(since, tokens, timeout_s)
            woken.append(name)

        tasks = [asyncio.ensure_future(wait(name, since, tokens))
                 for name, since, tokens in (("late", 3.0, 40), ("early", 1.0, 40), ("middle", 2.0, 40))]
        await asyncio.sleep(0.01)  # (a few turns of the loop)
        assert len(waits) == 3 and woken == []
        waits.freed(60)  # room for one prompt of 40 and part of another: the two earliest ask again
        await asyncio.sleep(0.01)  # (a few turns of the loop)
        assert woken == ["early", "middle"] and len(waits) == 1
        tasks.append(asyncio.ensure_future(wait("early", 1.0, 40)))  # refused again: back in its place, first
        await asyncio.sleep(0.01)  # (a few turns of the loop)
        waits.freed(1)  # any release wakes at least one
        await asyncio.sleep(0.01)  # (a few turns of the loop)
        assert woken == ["early", "middle", "early"]
        waits.freed(100)
        await asyncio.gather(*tasks)
        assert woken[-1] == "late" and len(waits) == 0
        waits.freed(10)  # with nobody waiting: nothing to do

    asyncio.run(scenario())


def test_with_no_release_a_wait_ends_at_its_timeout_and_leaves_the_queue():
    async def scenario():
        waits = RoomWaits()
        loop = asyncio.get_running_loop()
        started = loop.time()
        await waits.wait(1.0, 10, 0.02)
        assert loop.time() - started >= 0.02 and len(waits) == 0

    asyncio.run(scenario())
