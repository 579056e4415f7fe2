"""Who owns each sequence a worker holds, and when it may be taken back.

A coordinator names itself in its Prefill, Verify and Propose calls and in its
periodic ``Info`` poll (``owner``: an instance id of its own, made when it
starts); each renews that owner's lease on this worker. A sequence belongs to
the owner that created it. The worker takes a sequence back (frees its KV) when

* its owner's lease has run out: no call and no ``Info`` from that owner for
  ``lease_s`` (the coordinator crashed, was OOM-killed or cut off); or
* it has been idle for ``idle_ttl_s`` whatever its owner (a release that got
  lost while its coordinator lives on; a caller that names no owner).

The lease is per owner, never global: with many coordinators sharing the
workers, one that restarts or dies takes back only its own sequences.

The bookkeeping is thread safe: Info renews on the event loop as it arrives,
while calls renew and hold sequences, and sequences are dropped and swept, on
the model thread (only the model thread frees KV).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_LEASE_S = 30.0
DEFAULT_IDLE_TTL_S = 600.0
MIN_LEASE_S = 1.0  # shorter, and a live coordinator's heartbeat (a third of it) could not keep up
MAX_LEASE_S = 3600.0
MAX_IDLE_TTL_S = 7 * 24 * 3600.0
SWEEP_FRACTION = 0.25  # the worker looks for expired sequences every lease_s / 4: freed within 1.25 x lease_s
LEASE = "lease"
IDLE = "idle"


@dataclass(slots=True)
class _Held:
    owner: str  # "" when the caller named none: only the idle time-to-live applies
    last_used: float


@dataclass(slots=True, frozen=True)
class Expired:
    """A sequence to take back, and why: ``lease`` (its owner went silent) or ``idle``."""

    seq_id: str
    owner: str
    reason: str


class Leases:
    """Owners' last renewals and each held sequence's owner and last use (see the module doc)."""

    def __init__(self, lease_s: float = DEFAULT_LEASE_S, idle_ttl_s: float = DEFAULT_IDLE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # Validated where the worker's options are (tandem.config.WorkerConfig).
        self.lease_s = lease_s
        self.idle_ttl_s = idle_ttl_s  # 0: sequences of a live owner are never taken back for idleness
        self.clock = clock
        self._lock = threading.Lock()
        self._renewed: dict[str, float] = {}  # owner -> its last call or heartbeat
        self._held: dict[str, _Held] = {}  # seq_id -> its owner and last use

    @property
    def sweep_interval_s(self) -> float:
        """How often the worker should call ``expired``."""
        shortest = min(self.lease_s, self.idle_ttl_s) if self.idle_ttl_s else self.lease_s
        return shortest * SWEEP_FRACTION

    def renew(self, owner: str) -> None:
        """``owner`` was heard from (a call, or its heartbeat). Any thread."""
        if owner:
            with self._lock:
                self._renewed[owner] = self.clock()

    def hold(self, seq_id: str, owner: str) -> None:
        """A call of ``owner`` ran on ``seq_id``: it is the sequence's owner from now on, and renewed."""
        with self._lock:
            now = self.clock()
            self._held[seq_id] = _Held(owner, now)
            if owner:
                self._renewed[owner] = now

    def owner_of(self, seq_id: str) -> str | None:
        """The sequence's owner ("" for none); None when it is not held."""
        with self._lock:
            held = self._held.get(seq_id)
            return None if held is None else held.owner

    def drop(self, seq_id: str) -> None:
        """The sequence was released."""
        with self._lock:
            self._held.pop(seq_id, None)

    def expired(self) -> list[Expired]:
        """The sequences to take back now. Owners whose lease ran out are forgotten (a coordinator that
        comes back renews afresh), so the table holds only owners heard from within a lease."""
        with self._lock:
            now = self.clock()
            lapsed = {owner for owner, at in self._renewed.items() if now - at > self.lease_s}
            for owner in lapsed:
                del self._renewed[owner]
            found = []
            for seq_id, held in self._held.items():
                if held.owner and held.owner not in self._renewed:
                    found.append(Expired(seq_id, held.owner, LEASE))
                elif self.idle_ttl_s and now - held.last_used > self.idle_ttl_s:
                    found.append(Expired(seq_id, held.owner, IDLE))
            return found
