"""A request moves at most ``max_moves`` times per role: a fault that follows it ends as an error."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

from coordinator.placement import Placement


@dataclass
class FakeClient:
    name: str
    active: int = 0

    def for_request(self, deadline, max_len=0, priority=0, arrival_time=0.0, room=None, metadata=()):
        return ("channel", self.name, max_len, priority, arrival_time)


class FakePool:
    """Always has another replica to offer, so only the bound can stop a move."""

    def __init__(self, role: str) -> None:
        self.names = (f"{role}-{i}" for i in itertools.count())
        self.offered: list[FakeClient] = []

    def pick(self, avoid=None, key=None, tokens=0) -> FakeClient:
        return FakeClient(next(self.names))

    async def replacement(self, old, wait_s: float, key=None, tokens=0) -> FakeClient:
        self.offered.append(FakeClient(next(self.names)))
        return self.offered[-1]


def test_faulty_moves_stop_at_the_bound_per_role_and_capacity_moves_do_not_count():
    async def scenario():
        targets, drafts = FakePool("target"), FakePool("draft")
        moved: list[str] = []
        placement = Placement(targets, drafts, uses_draft=True, deadline=None, max_moves=2, move_wait_s=0.0,
                              on_move=moved.append, max_len=90, priority=-2, arrival_time=1.5e9)
        placement.enter()
        assert await placement.replace_target(faulty=False) is not None  # a full KV pool: not a fault
        assert placement.target_moves == 0
        for expected in (1, 2):
            # a moved request's Prefills still say how long it may get (the room its new target keeps it), its
            # priority and when it arrived (its place where the new target's pool is full)
            assert await placement.replace_target(faulty=True) == ("channel", targets.offered[-1].name, 90, -2, 1.5e9)
            assert placement.target_moves == expected
        assert await placement.replace_target(faulty=True) is None  # the third fault: no more moves
        assert len(targets.offered) == 2
        for _ in range(2):
            assert await placement.replace_draft() is not None
        assert await placement.replace_draft() is None and placement.draft is None
        assert moved == ["target", "target", "draft", "draft"]
        placement.leave()
        assert placement.target.active == 0  # the counts follow the request and are returned

    asyncio.run(scenario())


def test_with_no_moves_allowed_the_first_fault_ends_the_request():
    async def scenario():
        placement = Placement(FakePool("target"), FakePool("draft"), uses_draft=False, deadline=None, max_moves=0,
                              move_wait_s=0.0)
        assert await placement.replace_target(faulty=True) is None
        assert await placement.replace_draft() is None

    asyncio.run(scenario())
