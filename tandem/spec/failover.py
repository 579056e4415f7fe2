"""Channels that survive their replicas: the coordinator wraps a request's verifier and draft channel in them.

The speculation loop runs one round after another against a ``Verifier`` and
a ``DraftChannel`` and never sees a replica fail; these wrappers, built over
the coordinator's ``ReplicaSource`` (``coordinator.placement``), do:

- a target replica that fails the request (``REPLICA_FAULTS``) is replaced,
  and the new one rebuilt from the committed history (a Prefill of all of it
  with ``prompt_len``, which builds the KV of all but the last token); then
  the call is repeated there;
- a full KV pool preempts the request: its KV is freed, it waits (jittered
  backoff) and is rebuilt on the replica that has room then, maybe the same;
- a draft replica that fails is replaced, or the request goes on without
  one; either way that call gives up (no tokens, ``Drafted.lost``), and with
  no replica left it says so (``Drafted.gone``): the loop then goes on with
  n-gram proposals. A full draft pool gives up on that call alone; a request
  that has outgrown the draft's whole pool (a draft on a smaller GPU than the
  target's) is left by its draft for good, as no call could hold it again.

The history lives in the request's ``RequestState``, so no token is lost or
repeated and greedy output is the same. In process there are no replicas and
nothing is wrapped: a failure there reaches the caller.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from tandem.errors import InternalError, KVCacheExhaustedError, WorkerUnavailableError
from tandem.rpc.room_waits import ROOM_HOLD_S
from tandem.sampling_params import SamplingParams
from tandem.spec.request import GenerationStats, RequestState
from tandem.spec.room_queue import QueueKey, RoomQueue, Turn
from tandem.spec.transport import DraftChannel, Drafted, FittedCost, Prefilled, ReplicaSource, Verified, Verifier

T = TypeVar("T")
log = logging.getLogger(__name__)

# A replica's failure of a request: it is gone or hung (UNAVAILABLE), or it refused a call the
# coordinator made correctly (INTERNAL: e.g. it restarted and no longer knows the sequence).
REPLICA_FAULTS = (WorkerUnavailableError, InternalError)
# A full KV pool: the request frees its KV and waits, from KV_BACKOFF_S doubling to KV_BACKOFF_MAX_S
# (jittered, so preempted requests do not return in lockstep), at most KV_WAIT_MAX_S in all.
KV_BACKOFF_S = 0.05
KV_BACKOFF_MAX_S = 2.0
KV_WAIT_MAX_S = 300.0
# In a coordinator's room queue only its first request asks again, so it may ask sooner: at most this apart (besides
# at once when one of the coordinator's requests frees room), for what other coordinators' requests free.
ROOM_PAUSE_MAX_S = 0.5
# A Prefill refused for room asks again to be held by its worker for ``room_hold_s`` (``ROOM_HOLD_S`` by default,
# ``--room-hold``; ``PrefillRequest.wait_for_room_s``): admitted there in the step that frees its room, by whomever.
# The pause before asking again counts the time held, so a worker that held it asks again at once, and one that does
# not hold (an older worker) is asked as before. Held longer, a request could not move to another replica that frees
# room meanwhile, and the worker would hear later of the requests that joined the queue behind it (``queued``).


class Tally(Protocol):
    """A count that goes up and down (a Prometheus gauge): the requests waiting now."""

    def inc(self) -> None: ...

    def dec(self) -> None: ...


def _in_background(call: Awaitable[Any], tasks: set[asyncio.Task]) -> None:
    """Run a best-effort call (the release of a replica the request left) without waiting for it: a hung
    replica must not hold the move up. ``tasks`` keeps it alive until done; its error is retrieved."""
    task = asyncio.ensure_future(call)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    task.add_done_callback(lambda done: done.cancelled() or done.exception())


def _worker_of(channel: Any) -> Any:
    """What identifies the worker a channel calls: a coordinator's channels (``RequestChannel``) name their worker's
    client; any other channel stands for itself."""
    return getattr(channel, "worker", channel)


def _name_of(channel: Any) -> str:
    """The address of the worker a coordinator's channel calls, for a log line (else the channel's name, or "?")."""
    worker = _worker_of(channel)
    return str(getattr(worker, "address", None) or getattr(worker, "name", "?"))


class FailoverVerifier:
    """A ``Verifier`` on the request's current target replica, replacing it when it fails the request.

    ``rebuild_propose(target)``: the heads' node budget a rebuild on ``target`` asks for (0: the request
    has no heads; otherwise the heads' KV must be rebuilt along with the target's). ``waiting``: counts the
    request while it waits (for room in a full pool, preempted or not yet admitted, or for a healthy replica after a
    fault) until its call is served: the coordinator's queue, as a scheduler's waiting queue counts. ``room``: the
    coordinator's queue of requests waiting for room (``tandem.spec.room_queue``), where this one waits its turn at
    ``queue_key`` (its priority and start); None: it backs off alone. ``room_hold_s``: how long each Prefill after a
    refusal for room asks its worker to hold it until room frees (0: refused at once, asked again after a pause).
    ``on_refused(preempted, held_s)``: told of each refusal for room (``preempted``: the target held the sequence's
    KV, now released; ``held_s``: how long the refused call took), for the request's trace.
    """

    def __init__(self, target: Verifier, replicas: ReplicaSource, state: RequestState,
                 rebuild_propose: Callable[[Verifier], int], waiting: Tally | None = None,
                 room: RoomQueue | None = None, queue_key: QueueKey = (0, 0.0),
                 room_hold_s: float = ROOM_HOLD_S,
                 on_refused: Callable[[bool, float], None] | None = None) -> None:
        self.target = target
        self.replicas = replicas
        self.state = state  # the committed history a rebuild feeds, and the stats moves count in
        self.rebuild_propose = rebuild_propose
        self.waiting = waiting
        self.room = room
        self.queue_key = queue_key
        self.room_hold_s = room_hold_s
        self.on_refused = on_refused
        self._releases: set[asyncio.Task] = set()

    @property
    def streams(self) -> int:
        return self.target.streams

    def fitted_cost(self) -> FittedCost | None:
        return self.target.fitted_cost()

    async def prefill(self, seq_id: str, token_ids: list[int], sampling: SamplingParams, prompt_len: int = 0,
                      propose: int = 0) -> Prefilled:
        # A replacement gets this very Prefill: nothing to rebuild before it.
        return await self._survive(
            seq_id, lambda v, hold: v.prefill(seq_id, token_ids, sampling, prompt_len, propose, wait_for_room_s=hold),
            rebuild=False)

    async def verify(self, seq_id: str, committed_len: int, draft_tokens: list[int], draft_probs: Sequence[Any],
                     draft_parents: Sequence[int] = (), propose: int = 0) -> Verified:
        return await self._survive(seq_id, lambda v, _hold: v.verify(seq_id, committed_len, draft_tokens,
                                                                     draft_probs, draft_parents, propose))

    async def release(self, seq_id: str) -> None:
        await self.target.release(seq_id)

    async def _survive(self, seq_id: str, call: Callable[[Verifier, float], Awaitable[T]], rebuild: bool = True) -> T:
        """``call(target, hold)`` on the current target, moving or preempting the request as its replica requires;
        ``hold``: how long a Prefill may be held there for room (``room_hold_s`` once the request was refused).

        ``rebuild``: before repeating the call on a replica that does not hold the sequence, rebuild
        it there from the committed history.
        """
        waiting = _Wait(self.waiting, self.state.stats, self.room, self.queue_key,
                        place=(seq_id, lambda: self.target, lambda: len(self.state.history)))
        try:
            return await self._until_served(seq_id, call, rebuild, waiting)
        finally:
            waiting.end()

    async def _until_served(self, seq_id: str, call: Callable[[Verifier, float], Awaitable[T]], rebuild: bool,
                            waiting: _Wait) -> T:
        s = self.state
        needs_rebuild = False
        backoff, waited = KV_BACKOFF_S, 0.0
        hold = 0.0  # how long its next Prefill may be held for room: none at first, so a refusal may move it
        while True:
            holds = rebuild  # whether the target holds the sequence's KV: a Verify's does, a first Prefill's not yet
            if not holds or needs_rebuild:  # it asks for room: behind the requests ranked before it that wait
                waited += await waiting.behind_earlier()
            asked = time.perf_counter()
            try:
                if needs_rebuild:
                    holds = False
                    await self.target.prefill(seq_id, s.history, s.sampling, len(s.prompt_ids),
                                              propose=self.rebuild_propose(self.target), wait_for_room_s=hold)
                    holds = True
                return await call(self.target, hold)
            except KVCacheExhaustedError:
                refused_after = time.perf_counter() - asked  # (held by the worker, or on its way there and back)
                waited += refused_after
                if waited >= KV_WAIT_MAX_S:
                    raise
                waiting.start()
                if holds:  # preempted: others get its blocks meanwhile
                    await self.target.release(seq_id)
                    s.stats.preemptions += 1
                    waiting.room_freed()
                else:
                    s.stats.room_waits += 1
                if self.on_refused is not None:
                    self.on_refused(holds, refused_after)
                # (a refused Prefill holds nothing: the worker admits a call whole or not at all, and drops the
                # chunks it computed of a prompt it then refuses; under a burst, a release per refusal queued
                # hundreds of needless calls on the busy worker)
                waited += await waiting.pause(max(0.0, backoff * random.uniform(0.5, 1.5) - refused_after))
                backoff = min(2 * backoff, KV_BACKOFF_MAX_S if self.room is None else ROOM_PAUSE_MAX_S)
                hold = self.room_hold_s
                replacement = await self.replicas.replace_target(faulty=False)
                if replacement is None:
                    raise
                if not holds and _worker_of(replacement) is not _worker_of(self.target):
                    # it asks elsewhere now: the worker that refused it forgets the place it kept for it
                    # (tandem.rpc.room_waits), rather than hold it against later prompts for seconds
                    _in_background(self.target.release(seq_id), self._releases)
            except REPLICA_FAULTS as fault:
                waiting.start()
                replacement = await self.replicas.replace_target(faulty=True)
                if replacement is None:
                    raise
                same = _worker_of(replacement) is _worker_of(self.target)
                # (an operator reading the log of a replica's death sees its requests go on, not only a failed release)
                log.info("request %s moves %s target replica (%s) after %s; its %d tokens are read again there",
                         seq_id, "back to the same" if same else "to another", _name_of(replacement), fault,
                         len(s.history))
                release = self.target.release(seq_id)  # frees its KV if it is still there
                if same:
                    # The same worker, healthy again (one that was only slow): the release goes first. Sent beside
                    # the repeated call, it could land after it and free the sequence that call made (measured: a
                    # request queued behind a 71 s prompt moved back to its only target three times, each Verify
                    # then found no sequence, and the client got an internal error).
                    await release
                else:
                    _in_background(release, self._releases)
                s.stats.target_moves += 1
            self.target = replacement
            needs_rebuild = rebuild


class _Wait:
    """One call's wait: from its first refusal or fault (or its queueing behind earlier requests) until it ends,
    counted once in the ``waiting`` tally, timed into the request's ``queue_s``, and, waiting for room, in its
    place in the coordinator's ``room`` queue."""

    def __init__(self, tally: Tally | None, stats: GenerationStats, room: RoomQueue | None, key: QueueKey,
                 place: tuple[str, Callable[[], Any] | None, Callable[[], int] | None] = ("", None, None)) -> None:
        self.tally = tally
        self.stats = stats
        self.room = room
        self.key = key
        # (sequence id, its current target's channel, its Prefill's tokens): what its queue turn tells that target
        self.place = place
        self.since: float | None = None  # when it started waiting; None: not waiting
        self.turn: Turn | None = None  # its place in the room queue, once it has one

    def start(self) -> None:
        if self.since is None:
            self.since = time.perf_counter()
            if self.tally is not None:
                self.tally.inc()

    async def behind_earlier(self) -> float:
        """Before asking for room: while requests ranked before it wait, it queues behind them for its turn; the
        seconds it waited (0: none was waiting, or it already holds a place)."""
        if self.room is None or self.turn is not None or not self.room.ahead_of(self.key):
            return 0.0
        self.start()
        self.turn = self.room.join(self.key, *self.place)
        started = time.perf_counter()
        await self.room.wait_turn(self.turn, 0.0)
        return time.perf_counter() - started

    async def pause(self, backoff_s: float) -> float:
        """Refused for room: wait before asking again, alone (``backoff_s``) or in the queue (its turn, then at
        most ``backoff_s`` or until room may have freed); the seconds it waited."""
        started = time.perf_counter()
        if self.room is None:
            await asyncio.sleep(backoff_s)
        else:
            if self.turn is None:
                self.turn = self.room.join(self.key, *self.place)
            await self.room.wait_turn(self.turn, backoff_s)
        return time.perf_counter() - started

    def room_freed(self) -> None:
        if self.room is not None:
            self.room.room_freed()

    def end(self) -> None:
        if self.turn is not None and self.room is not None:
            self.room.leave(self.turn)  # the next one's turn
            self.turn = None
        if self.since is not None:
            self.stats.queue_s += time.perf_counter() - self.since
            self.since = None
            if self.tally is not None:
                self.tally.dec()


class FailoverDraft:
    """A ``DraftChannel`` on the request's current draft replica: one that fails is replaced, or the request
    drafts no more. A call that fails gives up (``Drafted([], lost=True)``) rather than raise."""

    def __init__(self, channel: DraftChannel, replicas: ReplicaSource, stats: GenerationStats) -> None:
        self.channel: DraftChannel | None = channel  # None while replacing it, and once none is left
        self.replicas = replicas
        self.stats = stats  # draft_moves counts the faults, replaced or not
        self.gone = False  # no draft replica is left for the request
        self._opened = False  # whether the current replica may hold the sequence (then it must be released)
        self._releases: set[asyncio.Task] = set()

    def fitted_cost(self) -> FittedCost | None:
        return self.channel.fitted_cost() if self.channel is not None else None

    def cached_prefix(self, token_ids: Sequence[int]) -> int:
        return self.channel.cached_prefix(token_ids) if self.channel is not None else 0

    async def propose(self, seq_id: str, committed_len: int, new_tokens: list[int], k: int,
                      sampling: SamplingParams, alternatives: int = 0, prompt_len: int = 0,
                      verified_len: int = 0, stop_below: float = 0.0) -> Drafted:
        channel = self.channel
        if channel is None:  # (being replaced after a concurrent call's failure, or none left)
            return Drafted([], lost=True, gone=self.gone)
        room = channel.sequence_room()
        if room is not None and committed_len + len(new_tokens) > room:
            # The draft's whole pool could not hold the sequence, and a sequence only grows: every further call
            # would be refused as full. The request goes on without a draft (n-gram proposals), as with none left.
            self.channel, self.gone = None, True
            if self._opened:
                self._opened = False
                _in_background(channel.release(seq_id), self._releases)
            log.info("request %s (%d tokens) outgrew its draft's KV pool (%d tokens a sequence): it goes on "
                     "without the draft", seq_id, committed_len + len(new_tokens), room)
            return Drafted([], lost=True, gone=True)
        self._opened = True
        try:
            return await channel.propose(seq_id, committed_len, new_tokens, k, sampling, alternatives, prompt_len,
                                         verified_len, stop_below)
        except KVCacheExhaustedError:
            return Drafted([], lost=True)  # the draft is full: this round goes without it
        except REPLICA_FAULTS:
            if self.channel is channel:  # not already replaced after a concurrent call's failure
                await self._replace(seq_id)
            return Drafted([], lost=True, gone=self.gone)

    async def release(self, seq_id: str) -> None:
        if self.channel is not None and self._opened:
            self._opened = False
            await self.channel.release(seq_id)

    async def _replace(self, seq_id: str) -> None:
        lost, self.channel, self._opened = self.channel, None, False
        assert lost is not None
        _in_background(lost.release(seq_id), self._releases)  # best effort: frees its KV if it is still there
        self.stats.draft_moves += 1
        self.channel = await self.replicas.replace_draft()
        self.gone = self.channel is None
        log.info("request %s lost its draft replica: it goes on %s", seq_id,
                 "with n-gram proposals alone" if self.gone else f"with another ({_name_of(self.channel)})")
