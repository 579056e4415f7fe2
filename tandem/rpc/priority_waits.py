"""Prompts refused for room that keep their place ahead of sequences ranked below them.

A worker keeps no queue: a Prefill its KV pool cannot hold is refused, and the coordinator asks again
after a backoff (``tandem.spec.failover``). Under FCFS that is enough, as whatever frees room goes to
whoever asks next. With priorities it is not: the running sequences of a low priority go on growing
into every block that frees, and a high-priority prompt that arrived to a full pool would wait for them
to end. So a refused prompt ranked above some held sequence is remembered here for a while, and
``PagedKVCache.admit`` sets its blocks aside ahead of the calls ranked below it: those are refused as
they grow (their coordinators preempt them and ask again later), until the prompt's next try fits.

A remembered prompt is forgotten once admitted, or ``HOLD_S`` after its last refusal: longer than the
coordinator's longest pause between tries, so that a prompt still asking is never forgotten, and short
enough that one given up (cancelled, or moved to another replica) holds nothing for long.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container
from typing import NamedTuple

# The coordinator's longest pause between tries is KV_BACKOFF_MAX_S (2 s) times its jitter (at most 1.5).
HOLD_S = 5.0


class _Wait(NamedTuple):
    rank: int
    blocks: int
    until: float


class PriorityWaits:
    """The refused prompts, by sequence id, that keep their place. Used on the model thread only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._waits: dict[str, _Wait] = {}

    def refused(self, seq_id: str, rank: int, blocks: int) -> None:
        """A new sequence of ``rank`` that needs ``blocks`` was refused for room."""
        self._waits[seq_id] = _Wait(rank, blocks, self._clock() + HOLD_S)

    def admitted(self, seq_id: str) -> None:
        self._waits.pop(seq_id, None)

    def holding(self, asking: Container[str]) -> list[tuple[int, int]]:
        """(rank, blocks) of each prompt still waiting, but for those ``asking`` in this batch (their call stands
        for them); forgets those past their time."""
        now = self._clock()
        for seq_id in [s for s, wait in self._waits.items() if wait.until <= now]:
            del self._waits[seq_id]
        return [(wait.rank, wait.blocks) for seq_id, wait in self._waits.items() if seq_id not in asking]

    def __len__(self) -> int:
        return len(self._waits)
