"""What the target's and the draft's engines share: a table of sequences over one model engine,
and the first half of every batch.

A batch is handled in the same order on both workers, so that no call changes state before
every call has been checked:

1. Releases queued before any computing call of their sequence apply now; those queued after
   one wait until the batch is done (queue order, per sequence).
2. Every computing call is checked (``_check``, which changes nothing) and at most one call per
   sequence is taken; a bad call fails alone. A call of a sequence another owner holds is refused.
3. The KV pool admits the checked calls together, or refuses the ones it cannot hold: the oldest
   sequences first, new ones only while the running ones keep room to grow
   (``PagedKVCache.admit``); the admitted calls hold their sequences for their owner
   (``tandem.rpc.leases``).

What the admitted calls then do (one forward pass, k draft steps) is each engine's own.

Sequences whose owner's lease ran out, or that sat idle too long, are taken back by ``reclaim``,
which the worker runs on the model thread like every batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from tandem.attention.sdpa import ROWWISE_MAX_QUERY
from tandem.block_pool import PrefixCacheStats
from tandem.errors import InvalidRequestError, KVCacheExhaustedError, StaleSequenceError
from tandem.rpc.calls import ReleaseCall
from tandem.rpc.leases import Expired, Leases
from tandem.rpc.room_waits import RoomWaits, Waiting
from tandem.spec.adaptive import IN_FLIGHT_TOKENS

# A new sequence starts only while every running one keeps free the blocks of its next GROWTH_ROUNDS rounds (a round
# appends at most IN_FLIGHT_TOKENS), or of the rest of its answer where its Prefill said how long it may get
# (``max_len``) and that is less. Without that room a burst of prompts filled the pool and every running sequence
# was refused, preempted and computed again in turn (200 streams at once on a 256-block SmolLM2 target: 1,732
# preemptions, 120 s, against 40 s for the same requests sent 32 at a time). Keeping each one the rest of its
# answer instead (TGI's reservation, up to 128 tokens) measured the same on that burst, side by side in one run
# (199.7 against 195.8 tokens/s, two rounds each; benchmarks/README.md); two rounds start more prompts early and
# hold less for long answers, where 128 tokens a sequence would cap how many run at once, and what outgrows them
# preempts the youngest, which are cheap to compute again.
GROWTH_ROUNDS = 2


def _growth_tokens(max_len: int, length: int) -> int:
    """The tokens a sequence of ``length`` keeps room to grow: its next ``GROWTH_ROUNDS`` rounds, less near its end
    (``max_len``, the most its KV may reach; 0: not known)."""
    rounds = GROWTH_ROUNDS * IN_FLIGHT_TOKENS
    return max(0, min(max_len - length, rounds)) if max_len else rounds


class Run(NamedTuple):
    """Tokens fed in one forward item, and whether they are prompt tokens (``ForwardItem.prompt``)."""

    tokens: list[int]
    prompt: bool


def history_runs(tokens: list[int], start: int, prompt_len: int) -> list[Run]:
    """How to feed ``tokens[start:]`` so that each token's KV is bitwise what the target computed.

    The target reads a request's prompt as prompt tokens (attention fixed by position, so any
    cut of the prompt into runs gives the same rows) and its generated tokens in Verify runs of at
    most ``ROWWISE_MAX_QUERY`` tokens (row by row, whatever the run's length). So: what is left
    of the prompt (``tokens[start:prompt_len]``) as one prompt run, then the generated tokens in
    runs of at most ``ROWWISE_MAX_QUERY``. Used by a target rebuild and by a draft reading what
    it has not seen (a draft of the target's own model then computes exactly what the target
    does). ``prompt_len`` 0: all of ``tokens`` is prompt.
    """
    prompt_len = prompt_len or len(tokens)
    runs = [Run(list(tokens[start:prompt_len]), True)] if start < prompt_len else []
    first = max(start, prompt_len)
    runs.extend(Run(list(tokens[i:i + ROWWISE_MAX_QUERY]), False)
                for i in range(first, len(tokens), ROWWISE_MAX_QUERY))
    return runs


class SequenceOwnedError(StaleSequenceError):
    """A call names a sequence that is live under another owner, or a Prefill names a live sequence
    without saying it rebuilds it (FAILED_PRECONDITION): the sequence is left as it was."""


class _Checked(Protocol):
    index: int  # the call's place in the batch
    call: Any  # has a seq_id and an owner
    kv_len: int  # the sequence's KV length once the call has run


Plan = TypeVar("Plan", bound=_Checked)
Sequence = TypeVar("Sequence")


class SequenceEngine(Generic[Sequence, Plan]):
    """A sequence table over one ``ModelEngine`` (``engine``), run only on the model thread. ``reserve_growth``:
    new sequences leave the running ones room for their next rounds (a worker serving coordinators; in process,
    ``tandem.kv_admission`` reserves each request's whole run before it starts instead)."""

    def __init__(self, engine, leases: Leases | None = None, reserve_growth: bool = False) -> None:
        self.engine = engine
        self.reserve_growth = reserve_growth
        self.sequences: dict[str, Sequence] = {}
        self.room_waits = RoomWaits()  # refused prompts that keep their place (with reserve_growth only)
        self.leases = leases or Leases()  # swept only where a worker runs ``reclaim`` (not in process)

    @property
    def vocab_size(self) -> int:
        return self.engine.config.vocab_size

    @property
    def max_context(self) -> int:
        return self.engine.config.max_position_embeddings

    @property
    def heads_kind(self) -> str:
        """The speculation heads this engine drafts with ("": none; only a target worker has them)."""
        return ""

    @property
    def caches_generated(self) -> bool:
        """Whether its prefix cache keeps generated tokens' blocks too (only a target's may)."""
        return False

    def heads_prefix_stats(self) -> PrefixCacheStats | None:
        """The prefix cache of its heads' own KV (an EAGLE head's, on a target); None where they keep none."""
        return None

    def shared_prompt_stats(self) -> tuple[int, int]:
        """(steps new Prefills waited for a prompt being computed, blocks with kept prompt scores): a target's
        (``target_worker.shared_prompts``, ``tandem.prompt_score_cache``); none elsewhere."""
        return 0, 0

    @property
    def num_sequences(self) -> int:
        return len(self.sequences)

    def _check(self, index: int, call) -> Plan:
        """What ``call`` will do, computed without changing anything; raises on a bad call."""
        raise NotImplementedError

    def _plan_batch(self, calls: list, results: list) -> tuple[list[Plan], list[int]]:
        """Steps 1-3 above. Fills ``results`` for releases applied now and for refused calls;
        returns the admitted plans and the indices of the releases to apply after the batch."""
        seen: set[str] = set()  # sequences with a computing call queued so far
        late: list[int] = []
        for i, call in enumerate(calls):
            if isinstance(call, ReleaseCall):
                if call.seq_id in seen:
                    late.append(i)
                else:
                    results[i] = self._release(call.seq_id)
            else:
                seen.add(call.seq_id)
                self.leases.renew(call.owner)  # every call renews its coordinator's lease, refused or not

        plans: list[Plan] = []
        planned: set[str] = set()
        for i, call in enumerate(calls):
            if isinstance(call, ReleaseCall):
                continue
            try:
                if call.seq_id in planned:
                    raise InvalidRequestError(f"sequence {call.seq_id!r} has two calls in this batch")
                self._check_owner(call)
                plans.append(self._check(i, call))
                planned.add(call.seq_id)
            except Exception as exc:  # noqa: BLE001 - one bad call fails alone
                results[i] = exc
        self._admit(plans, results)
        admitted = [p for p in plans if results[p.index] is None]
        for plan in admitted:
            self.leases.hold(plan.call.seq_id, plan.call.owner)
        return admitted, late

    def _check_owner(self, call) -> None:
        """A sequence is driven only by the owner that created it."""
        owner = self.leases.owner_of(call.seq_id) if call.seq_id in self.sequences else None
        if owner is not None and owner != call.owner:
            raise SequenceOwnedError(f"sequence {call.seq_id!r} belongs to another coordinator "
                                     f"({owner or 'none named'}), not to {call.owner or 'a caller naming none'}")

    def _release_late(self, calls: list, late: list[int], results: list) -> None:
        """Releases queued after a computing call of their sequence, once that call has run."""
        for i in late:
            results[i] = self._release(calls[i].seq_id)

    def _admit(self, plans: list[Plan], results: list) -> None:
        """Refuse (KVCacheExhaustedError) the calls the pool cannot hold together; change nothing. Higher
        priorities first (a Prefill's ``priority``, lower first), within one the oldest sequences first, then new
        ones by their requests' arrival, and with ``reserve_growth`` a new sequence starts only while every held
        one of its priority or higher keeps room for its next ``GROWTH_ROUNDS`` rounds (``PagedKVCache.admit``).
        A refused prompt that said when it arrived, or is ranked above a held sequence, keeps its place for its
        next try (``tandem.rpc.room_waits``)."""
        kv = self.engine.kv_cache
        lengths = [(plan.call.seq_id, plan.kv_len) for plan in plans]
        asked_priority = {plan.call.seq_id: getattr(plan.call, "priority", 0) for plan in plans}
        # When each call's request arrived at its coordinator (a target Prefill's arrival_time), on this worker's
        # clock; a call that does not say arrived now, as far as this worker can tell.
        now = time.time()
        said_arrival = {plan.call.seq_id: self._arrival(plan.call, getattr(plan.call, "arrival_time", 0.0))
                        for plan in plans}

        def rank(seq_id: str) -> int:
            seq = self.sequences.get(seq_id)
            return getattr(seq, "priority", 0) if seq is not None else asked_priority.get(seq_id, 0)

        def arrival(seq_id: str) -> float:
            return said_arrival.get(seq_id) or now

        growth: Callable[[str, int], int] | None = None
        waiting: list[Waiting] = []
        if self.reserve_growth:
            asked = {plan.call.seq_id: getattr(plan.call, "max_len", 0) for plan in plans}

            def growth(seq_id: str, length: int) -> int:
                return _growth_tokens(self._max_len(seq_id) or asked.get(seq_id, 0), length)

            self._learn_queued(plans)
            waiting = self.room_waits.holding(asked)
        lowest = max((rank(held) for held in self.sequences), default=0)  # the lowest priority held

        def keeps_place(seq_id: str) -> bool:
            """A new sequence refused for room keeps its place (blocks for its prompt and its room): ahead of the
            prompts of its rank that came after it, or of a held sequence ranked below it."""
            return (growth is not None and not kv.has_sequence(seq_id)
                    and bool(said_arrival.get(seq_id) or rank(seq_id) < lowest))

        for plan, short in zip(plans, kv.admit(lengths, growth, rank, waiting, arrival, keeps_place)):
            seq_id = plan.call.seq_id
            if short is None:
                self.room_waits.forget(seq_id)
                continue
            results[plan.index] = KVCacheExhaustedError(
                f"KV cache full: sequence {seq_id!r} needs {short} more blocks than are free; retry later")
            if keeps_place(seq_id):
                self.room_waits.refused(seq_id, Waiting(rank(seq_id), arrival(seq_id),
                                                        kv.blocks_needed(plan.kv_len + growth(seq_id, plan.kv_len))))

    def _learn_queued(self, plans: list[Plan]) -> None:
        """The requests waiting behind those that ask (a Prefill's ``queued``) keep their places as a refused prompt
        keeps its own: they wait at their coordinator without asking (``tandem.rpc.room_waits``)."""
        kv = self.engine.kv_cache
        for plan in plans:
            for queued in getattr(plan.call, "queued", ()):
                if queued.seq_id in self.sequences or kv.has_sequence(queued.seq_id):
                    continue  # (held here: it is no prompt waiting for room)
                blocks = kv.blocks_needed(queued.tokens + _growth_tokens(queued.max_len, queued.tokens))
                arrival = self._arrival(plan.call, queued.arrival_time) or time.time()
                self.room_waits.refused(queued.seq_id, Waiting(queued.priority, arrival, blocks))

    def _arrival(self, call: Any, when: float) -> float:
        """``when`` (a time the call's coordinator told, by its own clock) on this worker's clock; 0 stays 0."""
        return self.room_waits.clocks.on_this_clock(call.owner, when) if when else 0.0

    def _max_len(self, seq_id: str) -> int:
        """The most tokens a held sequence's KV may reach, as its Prefill said; 0: not known (a draft's)."""
        return getattr(self.sequences.get(seq_id), "max_len", 0)

    def _release(self, seq_id: str) -> bool:
        """Forget a sequence and free its KV; True when it was held. A prompt waiting for room here waits no more
        (its coordinator gave it up, or moved it)."""
        self.leases.drop(seq_id)
        self.room_waits.forget(seq_id)
        return self._free(seq_id)

    def _free(self, seq_id: str) -> bool:
        """Free a sequence's state and KV but leave it held by its owner (a rebuild replaces it)."""
        held = self.sequences.pop(seq_id, None) is not None
        if self.engine.kv_cache.has_sequence(seq_id):
            self.engine.release(seq_id)
        return held

    def reclaim(self) -> list[Expired]:
        """Free the sequences whose owner's lease ran out or that sat idle too long; what was freed.
        Runs on the model thread, between batches."""
        expired = self.leases.expired()
        for item in expired:
            self._release(item.seq_id)
        return expired
