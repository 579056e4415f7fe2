"""In process, requests start only while the KV pools can hold them: none is refused for a full pool.

A worker refuses a call its pool cannot hold (``KVCacheExhaustedError``), and the
coordinator preempts the request and retries it later (``tandem.spec.failover``). In
process there is no coordinator: ``SpeculativeGenerator.generate`` given more requests
than the pool holds at once had its first refused request fail the whole call (measured:
70 tiny requests on a 64-block pool), though each would have fitted in turn.

So each request reserves, before it starts, the blocks its longest run can take in every
pool it uses (its prompt, ``max_new_tokens`` and ``MAX_K`` + 1 tokens in flight), and
gives them back when it ends; requests start in the order given, each as soon as it fits.
The sum of reservations never passes a pool's size, so no call is refused for room. A
request longer than a whole pool reserves all of it (it then runs alone, and can still be
refused if it really grows that long, as before).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from tandem.kv_cache import PagedKVCache
from tandem.spec.adaptive import IN_FLIGHT_TOKENS


class KVAdmission:
    """Reservations of blocks in each of ``pools``, granted first come, first served."""

    def __init__(self, pools: Sequence[PagedKVCache]) -> None:
        self._pools = list(pools)
        self._free = [pool.num_blocks for pool in self._pools]
        self._turn = asyncio.Condition()
        self._queue: deque[object] = deque()  # waiting reservations, in arrival order

    def blocks_for(self, prompt_tokens: int, max_new_tokens: int) -> list[int]:
        """Blocks of each pool a request's longest run takes (at most the whole pool)."""
        tokens = prompt_tokens + max_new_tokens + IN_FLIGHT_TOKENS
        return [min(pool.blocks_needed(tokens), pool.num_blocks) for pool in self._pools]

    @asynccontextmanager
    async def hold(self, prompt_tokens: int, max_new_tokens: int) -> AsyncIterator[None]:
        """Wait for room for the request, hold it while the body runs, then give it back."""
        need = self.blocks_for(prompt_tokens, max_new_tokens)
        ticket = object()
        async with self._turn:
            self._queue.append(ticket)
            try:
                await self._turn.wait_for(lambda: self._queue[0] is ticket and self._fits(need))
            finally:
                self._queue.remove(ticket)  # granted, or given up (cancelled): the next in line may go
                self._turn.notify_all()
            self._free = [free - n for free, n in zip(self._free, need)]
        try:
            yield
        finally:
            async with self._turn:
                self._free = [free + n for free, n in zip(self._free, need)]
                self._turn.notify_all()

    def _fits(self, need: list[int]) -> bool:
        return all(free >= n for free, n in zip(self._free, need))
