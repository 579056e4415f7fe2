"""Continuous batching for a worker: calls queue up while the model is busy, then run together.

Each ``submit`` puts one call in the queue and awaits its own result. A single
background task takes everything waiting (up to a token budget), hands it to
``run_batch`` on a worker thread (so the event loop keeps accepting calls while
the model computes), and resolves each call's future with its result or its
own exception. Calls that arrive during a batch form the next one.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass(slots=True)
class _Pending(Generic[Item]):
    item: Item
    cost: int
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Batcher(Generic[Item, Result]):
    """Runs ``run_batch(items) -> list[Result | BaseException]`` over queued items."""

    def __init__(
        self,
        run_batch: Callable[[list[Item]], list[Result | BaseException]],
        cost: Callable[[Item], int],
        token_budget: int,
        on_batch: Callable[[int, int, float], None] | None = None,
    ) -> None:
        self.run_batch = run_batch
        self.cost = cost
        self.token_budget = token_budget
        self.on_batch = on_batch  # (num_items, num_tokens, seconds) after each batch: metrics
        self._queue: list[_Pending[Item]] = []
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._task: asyncio.Task | None = None

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, item: Item) -> Result:
        pending = _Pending(item, self.cost(item))
        self._queue.append(pending)
        self._wakeup.set()
        return await pending.future

    def _take_batch(self) -> list[_Pending[Item]]:
        batch, tokens = [], 0
        while self._queue:
            nxt = self._queue[0]
            if batch and tokens + nxt.cost > self.token_budget:
                break  # the first call always runs, even if alone it exceeds the budget
            batch.append(self._queue.pop(0))
            tokens += nxt.cost
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            batch = [p for p in self._take_batch() if not p.future.cancelled()]
            if not batch:
                continue
            started = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._executor, self.run_batch, [p.item for p in batch])
            except Exception as exc:  # noqa: BLE001 - a batch-wide failure fails each of its calls
                results = [exc] * len(batch)
            if self.on_batch:
                self.on_batch(len(batch), sum(p.cost for p in batch), time.perf_counter() - started)
            for pending, result in zip(batch, results):
                if pending.future.done():
                    continue
                if isinstance(result, BaseException):
                    pending.future.set_exception(result)
                else:
                    pending.future.set_result(result)
