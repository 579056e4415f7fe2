"""Prompts refused for room that keep their place: ahead of the prompts that came after them, and of sequences
ranked below them.

A worker keeps no queue: a Prefill its KV pool cannot hold is refused, and the coordinator asks again after a
pause (``tandem.spec.failover``; asked again, the Prefill is held here for up to a second first, and admitted if
room frees meanwhile: ``wait_for_room_s``, ``tandem.rpc.batcher``). Whatever frees room goes to whoever asks next,
and that is not always who came first:

- With priorities, the running sequences of a low priority go on growing into every block that frees, and a
  high-priority prompt that arrived to a full pool would wait for them to end.
- With several coordinators sharing the target, each orders its own waiting requests (``tandem.spec.room_queue``:
  only its first asks again), but the first of each asks on its own clock, and the one that asks just after room
  frees takes it, however long the other has waited.

So a refused prompt is remembered here for a while with its priority and its arrival (``PrefillRequest.
arrival_time``: when its request reached its coordinator, moved onto this worker's clock by
``tandem.rpc.coordinator_clocks``), and ``PagedKVCache.admit`` sets its blocks aside ahead of the new prompts of its
priority that arrived after it and of every call ranked below it: those prompts are refused, and sequences ranked
below refused as they grow (their coordinators preempt them and ask again later), until its next try fits. The
running sequences of its own priority or higher are never refused for it: first come, first served keeps what
runs running.

Only the first of a coordinator's waiting requests asks again; the others wait their turn there without asking.
So each Prefill tells of the coordinator's requests waiting behind it that are placed on this worker
(``PrefillRequest.queued``: their arrival, tokens, ``max_len`` and priority), and they keep their places here as a
refused prompt keeps its own. Comparing the coordinators' queues so, the worker merges them into one. (Told only of
the first, a worker let another coordinator's new prompts pass a queue's later requests whenever room freed for
several at once: 15-38 pairs of 780 out of order in most runs of benchmarks/README.md's room_queue_bench with
--coordinators 2, where 56-101 were with no order kept across coordinators.)

Which prompts are remembered: one ranked above some held sequence (the priority case), one whose call said when it
arrived (a coordinator's target Prefill; a draft's calls say nothing and hold no place), and the ones a Prefill
said queue behind it. A remembered prompt is forgotten once admitted, once released (its coordinator releases a
request that ends, is cancelled or asks another replica), or ``HOLD_S`` after it was last refused or told of:
longer than a coordinator's longest pause between tries, so that a prompt still waiting is never forgotten, and
short enough that the places of a coordinator that died go soon.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Container
from typing import NamedTuple

from tandem.errors import InvalidRequestError, KVCacheExhaustedError
from tandem.rpc.coordinator_clocks import CoordinatorClocks

# A coordinator's longest pause between tries is KV_BACKOFF_MAX_S (2 s) times its jitter (at most 1.5), and a worker
# holds a refused Prefill for room at most this long (``PrefillRequest.wait_for_room_s``), so that the places of the
# requests it named (``queued``) last until it asks again.
HOLD_S = 5.0
# How long a coordinator asks a Prefill refused for room to be held, by default (``--room-hold``;
# ``tandem.spec.failover``).
ROOM_HOLD_S = 1.0
MAX_QUEUED = 256  # waiting requests one Prefill tells of (PrefillRequest.queued): the first, in order


def check_room_hold(seconds: float) -> None:
    """A Prefill's ``wait_for_room_s``: 0 (refused at once) or a positive number of seconds (at most ``HOLD_S`` are
    held)."""
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidRequestError(f"wait_for_room_s must be a number of seconds >= 0, got {seconds}")


def room_hold_s(call: object, refusal: BaseException) -> float:
    """How long a call refused with ``refusal`` is held for room (``Batcher.hold_s``): a Prefill that asked to be
    (``wait_for_room_s``) and was refused because the KV pool was full, at most ``HOLD_S``; any other, not at all."""
    if not isinstance(refusal, KVCacheExhaustedError):
        return 0.0
    seconds = getattr(call, "wait_for_room_s", 0.0)
    return min(seconds, HOLD_S) if math.isfinite(seconds) and seconds > 0 else 0.0


class Waiting(NamedTuple):
    """A remembered prompt, as ``PagedKVCache.admit`` takes it."""

    rank: int  # its priority, lower first
    arrival: float  # when its request arrived (Unix seconds), to order it among the new prompts of its rank
    blocks: int  # the blocks it needs: its prompt and its room to grow


class QueuedPrompt(NamedTuple):
    """A coordinator's request waiting behind the one that asks (``PrefillRequest.queued``)."""

    seq_id: str
    arrival_time: float
    tokens: int  # the tokens its Prefill will carry
    max_len: int  # the most tokens its KV may reach (0: not known)
    priority: int


class RoomWaits:
    """The refused prompts, by sequence id, that keep their place. Used on the model thread only (``clocks`` aside)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.clocks = CoordinatorClocks()
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
