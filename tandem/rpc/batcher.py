"""Continuous batching for a worker: calls queue up while the model is busy, then run together.

Each ``submit`` puts one call in the queue and awaits its own result. A single
background task takes everything waiting (up to a token budget), hands it to
``run_batch`` on a worker thread (so the event loop keeps accepting calls while
the model computes), and resolves each call's future with its result or its
own exception. Calls that arrive during a batch form the next one.

Gathering: the sequences that called in the last two batches are the ones
cycling through this worker. When fewer of them are queued, the others are
usually a moment away (their coordinator is between a draft and a verify),
and starting now would run two part batches where one full one costs little
more, and on a shared machine would run the draft and target workers at the
same time, each slowing the other. So the loop waits for them, up to
``gather_wait_s()``; with one sequence, or all of them queued, it never
waits. A call that failed (refused for room, or bad) does not make its
sequence one to wait for. Under load this brings streams into step: a full verify batch sends
every stream to the draft worker at once, and back. A sequence that stops
calling (released, or drafting nothing at k = 0) drops out after two batches.

A call may take several batches: ``run_batch`` answers ``Unfinished()`` for one that
has done part of its work (a chunk of a long prompt, tandem/rpc/prefill_chunks.py),
and the call goes back to the head of the queue, with its cost asked anew, so that
its next part runs in the next batch beside whatever else is waiting.

A call refused for room (a Prefill a full KV pool cannot hold) may be held here instead of answered:
``hold_s(item, error)`` says for how many seconds (0: answered with its refusal at once). A held call
tries again beside every later batch, for a batch may free room (a release, a sequence that ends), and
is admitted in the very step that frees it; once its time is up it gets its last refusal. Answered at
once, it left the room that freed idle until its coordinator asked again (up to 0.75 s), or gave it to
whoever asked first, not to who waited longest. A held call alone never makes a batch run: only
something else can free room.

The model thread: by default each batcher has a thread of its own, and
``run_batch`` (every change to the engine's state) runs only there. In one
process, a draft engine's batcher and a target engine's batcher can be given
one shared single-thread ``executor``, so the two models never compute at
the same time (on a 2-core CPU they would only slow each other down).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tandem.rpc.call_timing import CURRENT_CALL, CallTiming

Item = TypeVar("Item")
Result = TypeVar("Result")

# Weight of the newest step in ``Batcher.calls_per_batch``: about the last ten steps count, so that it follows load
# as clients come and go within a few rounds.
CALLS_SMOOTHING = 0.1


class Unfinished:
    """A result meaning: this call has done part of its work; queue it again (first) for the next batch."""


@dataclass(slots=True)
class _Pending(Generic[Item]):
    item: Item
    cost: int
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    held_since: float = 0.0  # when it was first refused for room and held (perf_counter): the held calls' order
    held_until: float | None = None  # refused for room and held (perf_counter deadline); None: not held
    refusal: BaseException | None = None  # a held call's last refusal: its answer once its time is up
    timing: CallTiming | None = None  # a traced call's record of its steps (tandem.rpc.call_timing); None: untraced


class Batcher(Generic[Item, Result]):
    """Runs ``run_batch(items) -> list[Result | BaseException]`` over queued items."""

    def __init__(
        self,
        run_batch: Callable[[list[Item]], list[Result | BaseException]],
        cost: Callable[[Item], int],
        token_budget: int,
        on_batch: Callable[[int, int, float], None] | None = None,
        key: Callable[[Item], Hashable] | None = None,
        gather_wait_s: Callable[[], float] = lambda: 0.0,
        executor: Executor | None = None,
        hold_s: Callable[[Item, BaseException], float] | None = None,
    ) -> None:
        self.run_batch = run_batch
        self.cost = cost
        self.token_budget = token_budget
        self.on_batch = on_batch  # (num_items, num_tokens, seconds) after each batch: metrics
        self.key = key  # the sequence a call belongs to; None: no gathering
        self.gather_wait_s = gather_wait_s  # longest wait for the cycling sequences, asked anew per batch
        self._recent: deque[set[Hashable]] = deque(maxlen=2)  # sequences of the last two batches
        self._queue: list[_Pending[Item]] = []
        # Seconds a call refused with an error may be held for room (see the module doc); None: never held.
        self.hold_s = hold_s
        self._held: list[_Pending[Item]] = []  # calls refused for room, held: oldest first
        self._wakeup = asyncio.Event()
        # The model thread. A shared executor (see the module doc) belongs to the caller: stop() leaves it running.
        self._owns_executor = executor is None
        self._executor: Executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._task: asyncio.Task | None = None
        self._step_started: float | None = None  # perf_counter when the running batch began; None: idle
        self._step_tokens = 0  # the running batch's cost
        self._calls_per_batch = 0.0  # calls with a cost per batch that had any, a moving average (0: none ran yet)

    @property
    def executor(self) -> Executor:
        """Where ``run_batch`` runs; run other engine work (warm-up) here too."""
        return self._executor

    @property
    def queue_depth(self) -> int:
        """Calls waiting: for the next batch, or held for room."""
        return len(self._queue) + len(self._held)

    @property
    def held(self) -> int:
        """Calls refused for room and held until room frees or their time is up."""
        return len(self._held)

    @property
    def step_running_s(self) -> float:
        """Seconds the running batch has taken so far; 0 between batches. A coordinator tells a busy worker from a
        hung one by it (Info's ``step_running_s``): a call may wait long behind many batches, but a batch that runs
        far past its price (``step_tokens``, and the rows of the engine's running forward) is a hang."""
        started = self._step_started
        return 0.0 if started is None else time.perf_counter() - started

    @property
    def step_tokens(self) -> int:
        """The running batch's cost (its calls' ``cost``, the budget's unit); 0 between batches."""
        return 0 if self._step_started is None else self._step_tokens

    @property
    def calls_per_batch(self) -> float:
        """Calls that computed (a cost above 0: not a release) per batch step that had any, averaged over recent
        steps (0 before the first): how often the sequences calling here share a step (Info's ``calls_per_batch``)."""
        return self._calls_per_batch

    def forget(self, key: Hashable) -> None:
        """A released sequence: no batch waits for it any more."""
        for keys in self._recent:
            keys.discard(key)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        self.refuse_held()
        if self._owns_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, item: Item) -> Result:
        pending = _Pending(item, self.cost(item), timing=CURRENT_CALL.get())
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
        # Held calls try again beside it, oldest first, in what is left of the budget (the oldest in any case: a
        # batch of long chunks would otherwise keep it out). A refused one computes nothing; an admitted one its
        # first chunk, as it would have had its coordinator asked again.
        self._held = [p for p in self._held if not p.future.cancelled()]
        held = 0
        while held < len(self._held) and (held == 0 or tokens + self._held[held].cost <= self.token_budget):
            tokens += self._held[held].cost
            held += 1
        batch += self._held[:held]
        del self._held[:held]
        return batch

    def refuse_held(self) -> None:
        """Answer every held call with its refusal now (the worker drains or stops: its coordinator asks elsewhere)."""
        for pending in self._held:
            if not pending.future.done():
                pending.future.set_exception(pending.refusal)
        self._held.clear()

    def _refuse_expired(self) -> float | None:
        """Answer the held calls whose time is up with their refusal; seconds until the next one's is (None: none
        held)."""
        now = time.perf_counter()
        kept = []
        for pending in self._held:
            if pending.future.done():
                continue
            if pending.held_until is not None and pending.held_until <= now:
                pending.future.set_exception(pending.refusal)
            else:
                kept.append(pending)
        self._held = kept
        return min((p.held_until - now for p in kept if p.held_until is not None), default=None)

    def _hold(self, pending: _Pending[Item], refusal: BaseException) -> bool:
        """Whether ``pending``, refused with ``refusal``, is held for room (see the module doc). A held call that
        fails for another reason on a later try (a bad call, a worker that drains) is answered with it at once."""
        seconds = self.hold_s(pending.item, refusal) if self.hold_s is not None else 0.0
        if seconds <= 0:
            return False
        if pending.held_until is None:
            pending.held_since = time.perf_counter()
            pending.held_until = pending.held_since + seconds
        if time.perf_counter() >= pending.held_until:
            return False
        pending.refusal = refusal
        pending.cost = self.cost(pending.item)
        if pending.timing is not None:
            pending.timing.held += 1
        bisect.insort(self._held, pending, key=lambda p: p.held_since)  # oldest first, whatever batch it came from
        return True

    def _count_calls(self, computing: int) -> None:
        if computing:
            old = self._calls_per_batch
            self._calls_per_batch = computing if old == 0 else old + CALLS_SMOOTHING * (computing - old)

    async def _gather(self) -> None:
        """Wait up to ``gather_wait_s()`` for a call from every cycling sequence (see the module doc)."""
        wait_s = self.gather_wait_s()
        if self.key is None or wait_s <= 0:
            return
        deadline = time.perf_counter() + wait_s
        key = self.key
        while set().union(*self._recent) - {key(p.item) for p in self._queue}:  # cycling but not queued yet
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), left)
            except asyncio.TimeoutError:
                return

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            next_expiry = self._refuse_expired()
            if not self._queue:
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), next_expiry)
                except asyncio.TimeoutError:  # (not the builtin on Python 3.10)
                    continue  # a held call's time is up
            await self._gather()
            batch = [p for p in self._take_batch() if not p.future.cancelled()]
            if not batch:
                continue
            self._step_tokens = sum(p.cost for p in batch)
            self._count_calls(sum(1 for p in batch if p.cost > 0))
            started = self._step_started = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._executor, self.run_batch, [p.item for p in batch])
            except Exception as exc:  # noqa: BLE001 - a batch-wide failure fails each of its calls
                results = [exc] * len(batch)
            finally:
                self._step_started = None
            if self.key is not None:
                # The sequences that will call again: a call that failed (a prompt refused for a full pool, a bad
                # call) is not waited for. A burst's refused prompts come back only after their backoff, and every
                # batch waited out the gathering for them: 200 streams on one pool, 240-267 tokens/s, against 307
                # where each refusal's Release happened to forget them.
                self._recent.append({self.key(p.item) for p, r in zip(batch, results)
                                     if not isinstance(r, BaseException)})
            seconds = time.perf_counter() - started
            if self.on_batch:
                self.on_batch(len(batch), self._step_tokens, seconds)
            for pending in batch:
                if pending.timing is not None:
                    pending.timing.step(started, seconds, len(batch), self._step_tokens)
            unfinished = []
            for pending, result in zip(batch, results):
                if pending.future.done():
                    continue
                if isinstance(result, Unfinished):
                    pending.cost = self.cost(pending.item)
                    unfinished.append(pending)
                elif isinstance(result, BaseException):
                    if not self._hold(pending, result):
                        pending.future.set_exception(result)
                else:
                    pending.future.set_result(result)
            self._queue[:0] = unfinished  # ahead of calls that came later: a started prompt finishes first
