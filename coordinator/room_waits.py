"""Requests waiting for room in one target's KV pool, woken first come, first served.

A target refuses a Prefill its pool cannot hold with the room its running sequences keep to grow
(``PagedKVCache.admit``), and the request waits (``tandem.spec.failover``). Waiting out a backoff alone, a
burst's prompts came back at random moments: the pool sat idle while they slept, and the request that
came first was not served first. Here each wait ends when this coordinator's requests on that target
release what room the waiter needs (a release says how many tokens it held), the earliest request
(``since``, its start) woken first; a woken request that is refused again waits in its old place. The
backoff still ends every wait, for the room other coordinators free.
"""

from __future__ import annotations

import asyncio
import bisect


class RoomWaits:
    """The requests waiting for room on one target replica."""

    def __init__(self) -> None:
        self._waiting: list[tuple[float, int, int, asyncio.Future]] = []  # (since, order, tokens, woken), by since
        self._order = 0  # ties of ``since`` keep their arrival order

    def __len__(self) -> int:
        return len(self._waiting)

    async def wait(self, since: float, tokens: int, timeout_s: float) -> None:
        """Until room that ``tokens`` could fit in is released here (earlier requests woken first), or
        ``timeout_s``."""
        woken = asyncio.get_running_loop().create_future()
        self._order += 1
        entry = (since, self._order, tokens, woken)
        bisect.insort(self._waiting, entry, key=lambda e: (e[0], e[1]))
        try:
            await asyncio.wait((woken,), timeout=timeout_s)
        finally:
            if entry in self._waiting:
                self._waiting.remove(entry)

    def freed(self, tokens: int) -> None:
        """A sequence of ``tokens`` left the pool: wake the earliest waiters whose prompts that room could hold,
        at least one."""
        budget = tokens
        while self._waiting and budget > 0:
            _, _, asked, woken = self._waiting.pop(0)
            if not woken.done():
                woken.set_result(None)
            budget -= asked
