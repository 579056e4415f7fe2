"""The coordinator's waiting queue: requests waiting for room in a full target KV pool take their turns in order.

A target worker keeps no queue: a Prefill it has no room for is refused (held there a while first, when it asks to
be), and the request asks again later. Each
request used to back off on its own (50 ms doubling to 2 s, jittered), so whoever asked first after room freed got
it, and that favoured the newest: a request refused once asks again within 75 ms, one refused ten times within 3 s.
Measured under ``tandem up`` (SmolLM2, a 1,024-token pool, 40 requests of 200 tokens sent 0.25 s apart): 161 of
the 780 pairs saw their first tokens in the other order than they were sent, and a request sent at 4 s saw its
first token at 50 s while one sent at 8 s saw its first at 14 s.

Now each coordinator keeps one queue of its requests that wait for room, ordered by priority, then by when the
request started (a preempted request keeps its start, so it goes ahead of later ones, as vLLM puts preempted
requests back at the head of its waiting queue). Only the first asks again; the others wait for their turn, and
a request whose Prefill needs room while earlier ones wait queues behind them before it asks at all. The first
asks again after its backoff, or at once when room may have freed: one of this coordinator's requests released
its KV, or the one before it was admitted. A request ranked above every waiting one asks at once, as before.
Releases by other coordinators are seen only by the pause. Each coordinator orders its own requests; a target
shared by several orders them by when they arrived (``PrefillRequest.arrival_time``), keeping a waiting prompt's
place ahead of later ones (``tandem.rpc.room_waits``), which merges the queues into one. As only the first asks,
each of its Prefills tells its target of the others waiting behind it that are placed there (``queued``). Once
refused, the first's Prefills ask the target to hold them for room (``wait_for_room_s``,
``--room-hold``, 1 s by default): the target admits it in the step that frees its room, whichever coordinator's
request freed it, where it used to wait for the first's next try (up to 0.75 s; ``tandem.rpc.batcher``).
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A queue's place: (priority, start time); lower goes first.
QueueKey = tuple[int, float]


@dataclass(eq=False)
class Turn:
    """One request's place in the queue."""

    key: QueueKey
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # set: its turn came, or room may have freed
    # What a target is told of the requests waiting behind the one that asks (``RoomQueue.waiting``): the request's
    # sequence id, where it would ask (its current target's channel) and how many tokens its Prefill would carry.
    seq_id: str = ""
    where: Callable[[], Any] | None = None
    tokens: Callable[[], int] | None = None


class RoomQueue:
    """One coordinator's requests waiting for room, in order (asyncio: one event loop)."""

    def __init__(self) -> None:
        self._turns: list[Turn] = []  # ordered by key

    def __len__(self) -> int:
        return len(self._turns)

    def ahead_of(self, key: QueueKey) -> bool:
        """Whether a request ranked before ``key`` waits (a request asking for room then queues behind it)."""
        return bool(self._turns) and self._turns[0].key < key

    def waiting(self) -> list[Turn]:
        """The requests waiting now, in order (a target that one of them asks is told of the others placed on it)."""
        return list(self._turns)

    def join(self, key: QueueKey, seq_id: str = "", where: Callable[[], Any] | None = None,
             tokens: Callable[[], int] | None = None) -> Turn:
        turn = Turn(key, seq_id=seq_id, where=where, tokens=tokens)
        keys = [t.key for t in self._turns]
        self._turns.insert(bisect.bisect_right(keys, key), turn)
        return turn

    def leave(self, turn: Turn) -> None:
        """``turn`` no longer waits (admitted, given up or cancelled): the next one's turn comes."""
        was_first = bool(self._turns) and self._turns[0] is turn
        self._turns.remove(turn)
        if was_first and self._turns:
            self._turns[0].wake.set()

    def room_freed(self) -> None:
        """Room may have freed (a release): the first asks again now."""
        if self._turns:
            self._turns[0].wake.set()

    async def wait_turn(self, turn: Turn, pause_s: float) -> None:
        """Until ``turn`` may ask: once it is first, after ``pause_s`` or as soon as room may have freed; a turn
        that becomes first because the one before it left asks at once."""
        while self._turns[0] is not turn:
            await self._woken(turn, None)
            if self._turns[0] is turn:
                return  # the one before it left: its turn, now
        await self._woken(turn, pause_s)

    @staticmethod
    async def _woken(turn: Turn, timeout_s: float | None) -> None:
        try:
            await asyncio.wait_for(turn.wake.wait(), timeout_s)
        except asyncio.TimeoutError:  # (not the builtin on Python 3.10)
            pass
        turn.wake.clear()
