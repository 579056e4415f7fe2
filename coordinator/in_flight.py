"""The requests a coordinator is running, so that a drain can wait for them and end the rest clearly.

On SIGTERM a coordinator takes no new requests and gives those in flight its drain grace to finish. An answer
longer than the grace used to be cut when the servers stopped: a gRPC client got CANCELLED, an HTTP client a
dropped connection mid-stream, neither saying why. Now, shortly before the grace runs out (``CUT_S``), each
request still running is ended by the coordinator itself with ``ShuttingDownError`` (UNAVAILABLE on gRPC, which
clients retry; on HTTP a 503, or in a stream an ``error`` event with code ``draining`` and then ``[DONE]``),
while the servers can still deliver it. Its KV on the workers is released as for a client that went away.

How a request is ended depends on where its task is. Waiting for its own work (a worker call, its turn for
room), the task is cancelled: the loop unwinds as on a cancellation, and the service turns that one cancellation
into the error (``Tracked.ended``). Handed back to its API between rounds (gRPC writing a message), it is not
cancelled, which would cancel the write and the call with it: it ends as soon as it asks for its next round.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tandem.errors import ShuttingDownError

# What is left of the drain grace when the requests still running are ended: time for their errors to reach the
# clients before the servers stop.
CUT_S = 1.0


@dataclass(eq=False)
class Tracked:
    """One request in flight: the task running it, and whether it is to end."""

    task: asyncio.Task
    inside: bool = True  # at its own work; False while handed back to its API between rounds
    reason: str = ""  # set: it is to end, saying this
    cancelled: bool = False  # ended by a cancellation of its task (``ended`` takes it back)

    def ended(self) -> ShuttingDownError | None:
        """Where the request caught a cancellation: the error to raise instead where the cancellation was the
        drain's (taken back from the task, so that its error can still be written), else None (its client left)."""
        if not self.cancelled:
            return None
        self.cancelled = False
        uncancel = getattr(self.task, "uncancel", None)  # (Python 3.11+: a task counts its cancellations)
        if uncancel is not None:
            uncancel()
        return ShuttingDownError(self.reason)

    def check(self) -> None:
        """Where the request asks for its next round: raise if it is to end."""
        if self.reason:
            raise ShuttingDownError(self.reason)


class InFlight:
    """The requests running now."""

    def __init__(self) -> None:
        self._running: set[Tracked] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._running)

    @contextmanager
    def running(self) -> Iterator[Tracked]:
        """Around one request's run, in the task that runs it."""
        task = asyncio.current_task()
        assert task is not None, "a request runs in a task"
        tracked = Tracked(task)
        self._running.add(tracked)
        self._idle.clear()
        try:
            yield tracked
        finally:
            self._running.discard(tracked)
            if not self._running:
                self._idle.set()

    def end_all(self, reason: str) -> int:
        """End every request running now with ``ShuttingDownError(reason)``; returns how many."""
        ending = [tracked for tracked in self._running if not tracked.reason]
        for tracked in ending:
            tracked.reason = reason
            if tracked.inside and not tracked.task.done():
                tracked.cancelled = True
                tracked.task.cancel()
        return len(ending)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Whether every request ended within ``timeout_s``."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            return False
        return True

    async def drain(self, grace_s: float) -> int:
        """Wait for the requests in flight until ``CUT_S`` before ``grace_s`` is up, then end those still running
        and give their errors the rest of it. Returns how many were ended."""
        started = time.monotonic()
        if await self.wait_idle(grace_s - CUT_S):
            return 0
        count = self.end_all(f"the coordinator is shutting down and its drain grace ({grace_s:g} s) ran out before "
                             "this answer was done; send the request again")
        await self.wait_idle(grace_s - (time.monotonic() - started))
        return count
