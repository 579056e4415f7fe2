"""Prompts refused for room that keep their place: ahead of the prompts that came after them, and of sequences
ranked below them.

A worker keeps no queue: a Prefill its KV pool cannot hold is refused, and the coordinator asks again after a
pause (``tandem.spec.failover``). Whatever frees room goes to whoever asks next, and that is not always who came
first:

- With priorities, the running sequences of a low priority go on growing into every block that frees, and a
  high-priority prompt that arrived to a full pool would wait for them to end.
- With several coordinators sharing the target, each orders its own waiting requests (``tandem.spec.room_queue``:
  only its first asks again), but the first of each asks on its own clock, and the one that asks just after room
  frees takes it, however long the other has waited.

So a refused prompt is remembered here for a while with its priority and its arrival (``PrefillRequest.
arrival_time``: when its request reached its coordinator), and ``PagedKVCache.admit`` sets its blocks aside ahead
of the new prompts of its priority that arrived after it and of every call ranked below it: those prompts are
refused, and sequences ranked below refused as they grow (their coordinators preempt them and ask again later),
until its next try fits. The running sequences of its own priority or higher are never refused for it: first come,
first served keeps what runs running. As each coordinator's waiting requests ask in order, comparing the first of
each here merges their queues, as far as this worker knows their requests (below).

Which prompts are remembered: one ranked above some held sequence (the priority case), and one whose call said
when it arrived (a coordinator's target Prefill; a draft's calls say nothing and hold no place). A remembered prompt
is forgotten once admitted, once released (its coordinator releases a request that ends, is cancelled or asks
another replica), or ``HOLD_S`` after its last refusal: longer than a coordinator's longest pause between tries,
so that a prompt still asking is never forgotten. Only the first of a coordinator's waiting requests asks again,
so a later one is known here only if it was refused once (and for ``HOLD_S`` after): keeping every place for a
coordinator's lease (30 s) instead ordered two coordinators' requests a little better (13 and 15 pairs of 780 out
of order, against 15-38 in most runs at 5 s) but served 111-125 tokens/s against 153-182 (benchmarks/README.md,
room_queue_bench with --coordinators 2), so places go after ``HOLD_S``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container
from typing import NamedTuple

# A coordinator's longest pause between tries is KV_BACKOFF_MAX_S (2 s) times its jitter (at most 1.5).
HOLD_S = 5.0


class Waiting(NamedTuple):
    """A remembered prompt, as ``PagedKVCache.admit`` takes it."""

    rank: int  # its priority, lower first
    arrival: float  # when its request arrived (Unix seconds), to order it among the new prompts of its rank
    blocks: int  # the blocks it needs: its prompt and its room to grow


class RoomWaits:
    """The refused prompts, by sequence id, that keep their place. Used on the model thread only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._waits: dict[str, tuple[Waiting, float]] = {}  # seq_id -> (the prompt, when it is forgotten)

    def refused(self, seq_id: str, waiting: Waiting) -> None:
        """A new sequence was refused for room: it keeps its place for ``HOLD_S`` from now."""
        self._waits[seq_id] = (waiting, self._clock() + HOLD_S)

    def forget(self, seq_id: str) -> None:
        """It no longer waits here: admitted, or released (its coordinator gave it up or moved it)."""
        self._waits.pop(seq_id, None)

    def holding(self, asking: Container[str]) -> list[Waiting]:
        """The prompts still waiting, but for those ``asking`` in this batch (their call stands for them); forgets
        those past their time."""
        now = self._clock()
        for seq_id in [s for s, (_, until) in self._waits.items() if until <= now]:
            del self._waits[seq_id]
        return [waiting for seq_id, (waiting, _) in self._waits.items() if seq_id not in asking]

    def __len__(self) -> int:
        return len(self._waits)
