"""Each coordinator's wall clock against this worker's, so that the arrival times several coordinators tell
(``PrefillRequest.arrival_time``) are compared on one clock (``tandem.rpc.room_waits``)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class CoordinatorClocks:
    """How far each coordinator's wall clock runs behind this worker's, from its Info polls (``WorkerInfoRequest.
    sent_at``): arrival times are compared on this worker's clock. A coordinator whose clock ran an hour behind
    would otherwise have every request of its own go first, and the others' wait behind them.

    Each poll's offset is this worker's clock when it came less the coordinator's when it was sent: the true offset
    plus the poll's delay on its way (a millisecond in a cluster, more behind a busy event loop). The smallest of
    the last ``SAMPLES`` is taken. Heard on the event loop, read on the model thread: under a lock."""

    SAMPLES = 8
    # Coordinators remembered, the most recently heard (each restart of one is a new owner id: the table stays small)
    MAX_OWNERS = 256

    def __init__(self, wall_clock: Callable[[], float] = time.time) -> None:
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._offsets: dict[str, deque[float]] = {}  # owner -> its last offsets, least recently heard first

    def heard(self, owner: str, sent_at: float) -> None:
        offset = self._wall_clock() - sent_at
        with self._lock:
            offsets = self._offsets.pop(owner, None) or deque(maxlen=self.SAMPLES)
            offsets.append(offset)
            self._offsets[owner] = offsets
            if len(self._offsets) > self.MAX_OWNERS:
                del self._offsets[next(iter(self._offsets))]

    def on_this_clock(self, owner: str, when: float) -> float:
        """``when``, told by ``owner``'s clock, on this worker's (as told, for an owner not heard from)."""
        with self._lock:
            offsets = self._offsets.get(owner)
            return when + min(offsets) if offsets else when
