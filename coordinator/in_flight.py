"""The requests a coordinator is running, so that a drain can wait for them and end the rest clearly.

On SIGTERM a coordinator takes no new requests and gives those in flight its drain grace to finish. An answer
longer than the grace used to be cut when the servers stopped: a gRPC client got CANCELLED, an HTTP client a
dropped connection mid-stream, neither saying why. Now, shortly before the grace runs out (``CUT_S``), each
request still running is ended by the coordinator itself with ``ShuttingDownError`` (UNAVAILABLE on gRPC, which
clients retry; on HTTP a 503, or in a stream an ``error`` event with code ``draining`` and then ``[DONE]``),
while the servers can still deliver it. Its KV on the workers is released as for a client that went away.

A request is ended by cancelling the task that runs it (the one asyncio task iterating its stream: a gRPC
handler's, or one HTTP choice's): the loop unwinds as on a cancellation, and the service turns that one
cancellation into the error (``ended``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tandem.errors import ShuttingDownError

# What is left of the drain grace when the requests still running are ended: time for their errors to reach the
# clients before the servers stop.
CUT_S = 1.0


class InFlight:
    """The tasks running requests, counted per task (one task may run one request at a time, or a few in turn)."""

    def __init__(self) -> None:
        self._running: dict[asyncio.Task, int] = {}
        self._ended: set[asyncio.Task] = set()  # cancelled by ``end_all``, not by their clients
        self._idle = asyncio.Event()
        self._idle.set()
        self.reason = ""  # why they were ended, once they were

    def __len__(self) -> int:
        return sum(self._running.values())

    @contextmanager
    def running(self) -> Iterator[None]:
        """Around one request's run, in the task that runs it."""
        task = asyncio.current_task()
        assert task is not None, "a request runs in a task"
        self._running[task] = self._running.get(task, 0) + 1
        self._idle.clear()
        try:
            yield
        finally:
            left = self._running.pop(task) - 1
            if left:
                self._running[task] = left
            else:
                self._ended.discard(task)
            if not self._running:
                self._idle.set()

    def ended(self) -> ShuttingDownError | None:
        """Called where the current task's request caught a cancellation: the error to raise instead where the
        cancellation was ``end_all``'s (its one cancellation is taken back), else None (the client went away)."""
        task = asyncio.current_task()
        if task not in self._ended:
            return None
        self._ended.discard(task)
        uncancel = getattr(task, "uncancel", None)  # (Python 3.11+: the task counts cancellations)
        if uncancel is not None:
            uncancel()
        return ShuttingDownError(self.reason)

    def end_all(self, reason: str) -> int:
        """End every request running now with ``ShuttingDownError(reason)``; returns how many tasks were ended."""
        self.reason = reason
        fresh = [task for task in self._running if task not in self._ended and not task.done()]
        for task in fresh:
            self._ended.add(task)
            task.cancel()
        return len(fresh)

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
