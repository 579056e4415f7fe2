"""The failover wrappers on their own: what each replica is asked, in what order, and what the stats count.

Each fake replica records its calls and fails as scripted; the replica source
(test_loop_faults.py's) hands out spares in order and records what it was asked. The loop over these
wrappers is tests/spec/test_loop_faults.py.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from tandem.errors import InternalError, InvalidRequestError, KVCacheExhaustedError, WorkerUnavailableError
from tandem.sampling_params import SamplingParams
from tandem.spec import failover
from tandem.spec.adaptive import CostModel
from tandem.spec.failover import FailoverDraft, FailoverVerifier
from tandem.spec.loop import SpeculationLoop
from tandem.spec.options import SpecOptions
from tandem.spec.request import GenerationStats, RequestState, StopConditions
from tandem.spec.transport import Drafted, FittedCost, Prefilled, Verified
from tests.spec.test_loop import FakeTarget, target_only
from tests.spec.test_loop_faults import DyingDraft
from tests.spec.test_loop_faults import Replicas as Spares

PROMPT = [3, 1, 4, 1, 5]


class Replica:
    """A target or draft replica that raises the next of ``errors`` on each call (None: answers)."""

    def __init__(self, name: str, errors=(), cost: float = 0.1, streams: int = 1) -> None:
        self.name, self.errors = name, list(errors)
        self.calls: list[tuple] = []
        self.released: list[str] = []
        self.cost, self.streams = cost, streams
        self.room: int | None = None  # a draft's KV pool for one sequence (None: not known)

    def fitted_cost(self) -> FittedCost:
        return FittedCost(self.cost, 0.001)

    def cached_prefix(self, token_ids) -> int:
        return 0

    def sequence_room(self) -> int | None:
        return self.room

    def _answer(self, call: tuple) -> None:
        self.calls.append(call)
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise error

    async def prefill(self, seq_id, token_ids, sampling, prompt_len=0, propose=0, wait_for_room_s=0.0):
        self._answer(("prefill", list(token_ids), prompt_len, propose))
        return Prefilled(token_ids[-1] if prompt_len else 9)

    async def verify(self, seq_id, committed_len, draft_tokens, draft_probs, draft_parents=(), propose=0):
        self._answer(("verify", committed_len, list(draft_tokens), propose))
        return Verified([0], 8)

    async def propose(self, seq_id, committed_len, new_tokens, k, sampling, alternatives=0, prompt_len=0,
                      verified_len=0, stop_below=0.0):
        await asyncio.sleep(0)  # (calls overlap)
        self._answer(("propose", committed_len, list(new_tokens), k))
        return Drafted([7] * k)

    async def release(self, seq_id):
        self.released.append(seq_id)


def request(generated=(6, 2)) -> RequestState:
    state = RequestState(list(PROMPT), SamplingParams(), StopConditions(40))
    state.commit(list(generated))
    return state


def verifier(first: Replica, spares: Spares, state: RequestState, budgets: list | None = None) -> FailoverVerifier:
    """Over ``first``; a rebuild asks for 3 heads nodes and records the replica it asked for them on."""
    def rebuild_propose(target):
        if budgets is not None:
            budgets.append(target)
        return 3
    return FailoverVerifier(first, spares, state, rebuild_propose)


@pytest.mark.parametrize("error", [WorkerUnavailableError("gone"), InternalError("restarted")])
def test_a_failed_verify_moves_to_a_spare_rebuilt_from_the_history_then_repeats_there(error, caplog):
    caplog.set_level(logging.INFO, logger="tandem.spec.failover")
    state, budgets = request(), []
    dying, spare = Replica("dying", [error]), Replica("spare")
    spares = Spares(targets=[spare])
    wrapped = verifier(dying, spares, state, budgets)

    async def go():
        verified = await wrapped.verify("s", len(state.history), [4, 4], [], (), propose=2)
        await asyncio.sleep(0)  # the dying replica's release runs in the background
        return verified

    assert asyncio.run(go()) == Verified([0], 8)
    assert spares.asked == [("target", True)]
    assert spare.calls == [("prefill", [*PROMPT, 6, 2], len(PROMPT), 3),  # the rebuild, with the heads' budget
                           ("verify", len(PROMPT) + 2, [4, 4], 2)]  # then the very call
    assert budgets == [spare]  # the budget is the replacement's
    assert dying.released == ["s"] and spare.released == []
    assert wrapped.target is spare and wrapped.fitted_cost() == spare.fitted_cost()
    assert state.stats.target_moves == 1 and state.stats.preemptions == 0
    # an operator sees the request go on: where to, after what, and what is read again there
    assert f"request s moves to another target replica (spare) after {error}; its {len(PROMPT) + 2} tokens" \
        in caplog.text


def test_a_failed_prefill_is_repeated_on_the_spare_with_nothing_to_rebuild():
    state = RequestState(list(PROMPT), SamplingParams(), StopConditions(40))
    dying, spare = Replica("dying", [WorkerUnavailableError("gone")]), Replica("spare")
    wrapped = verifier(dying, Spares(targets=[spare]), state)
    assert asyncio.run(wrapped.prefill("s", PROMPT, state.sampling, propose=5)) == Prefilled(9)
    assert spare.calls == [("prefill", PROMPT, 0, 5)]
    assert state.stats.target_moves == 1


def test_a_full_pool_preempts_waits_and_rebuilds_on_the_replica_with_room_which_may_be_the_same(monkeypatch):
    monkeypatch.setattr(failover, "KV_BACKOFF_S", 0.001)
    state = request()
    full = Replica("full", [KVCacheExhaustedError("full"), None, KVCacheExhaustedError("full")])
    spares = Spares(targets=[full, full])
    wrapped = verifier(full, spares, state)
    asyncio.run(wrapped.verify("s", len(state.history), [4], []))
    assert spares.asked == [("target", False), ("target", False)]  # capacity, not a fault
    assert [c[0] for c in full.calls] == ["verify", "prefill", "verify", "prefill", "verify"]
    assert full.released == ["s", "s"]  # freed before each wait
    assert state.stats.preemptions == 2 and state.stats.target_moves == 0


def test_a_refused_prefill_holds_nothing_so_it_waits_without_a_release_or_a_preemption(monkeypatch):
    """A prompt refused for room (a burst) frees nothing: no Release is sent to the busy worker and no preemption
    is counted. A refused rebuild neither: only the Verify's refusal freed KV."""
    monkeypatch.setattr(failover, "KV_BACKOFF_S", 0.001)
    state = RequestState(list(PROMPT), SamplingParams(), StopConditions(40))
    full = Replica("full", [KVCacheExhaustedError("full")] * 2)
    wrapped = verifier(full, Spares(targets=[full] * 2), state)
    assert asyncio.run(wrapped.prefill("s", PROMPT, state.sampling)) == Prefilled(9)
    assert [c[0] for c in full.calls] == ["prefill"] * 3 and full.released == [] and state.stats.preemptions == 0
    assert state.stats.room_waits == 2
    state = request()
    full = Replica("full", [KVCacheExhaustedError("full"), KVCacheExhaustedError("full")])
    wrapped = verifier(full, Spares(targets=[full] * 2), state)
    asyncio.run(wrapped.verify("s", len(state.history), [4], []))
    assert [c[0] for c in full.calls] == ["verify", "prefill", "prefill", "verify"]
    assert full.released == ["s"] and state.stats.preemptions == 1 and state.stats.room_waits == 1


def test_a_refused_prefill_placed_on_another_replica_gives_up_its_place_on_the_first(monkeypatch):
    """The refusing worker kept the prompt's place (tandem/rpc/room_waits.py): asking elsewhere now, the request
    releases it there, so that it does not hold room against later prompts for seconds; still no preemption."""
    monkeypatch.setattr(failover, "KV_BACKOFF_S", 0.001)
    state = RequestState(list(PROMPT), SamplingParams(), StopConditions(40))
    full, roomy = Replica("full", [KVCacheExhaustedError("full")]), Replica("roomy")
    wrapped = verifier(full, Spares(targets=[roomy]), state)

    async def go():
        prefilled = await wrapped.prefill("s", PROMPT, state.sampling)
        await asyncio.sleep(0)  # the release runs in the background
        return prefilled

    assert asyncio.run(go()) == Prefilled(9)
    assert full.released == ["s"] and roomy.released == [] and roomy.calls == [("prefill", PROMPT, 0, 0)]
    assert state.stats.preemptions == 0 and state.stats.room_waits == 1


class Holding(Replica):
    """A target worker that holds a refused Prefill for the time it was asked to (``wait_for_room_s``), at most
    ``held_s``, before refusing it; notes each Prefill's hold."""

    def __init__(self, name: str, errors=(), held_s: float = 0.0) -> None:
        super().__init__(name, errors)
        self.held_s = held_s
        self.holds: list[float] = []

    async def prefill(self, seq_id, token_ids, sampling, prompt_len=0, propose=0, wait_for_room_s=0.0):
        self.holds.append(wait_for_room_s)
        if self.errors and self.errors[0] is not None:
            await asyncio.sleep(min(wait_for_room_s, self.held_s))
        return await super().prefill(seq_id, token_ids, sampling, prompt_len, propose)


def test_a_prefill_refused_for_room_asks_to_be_held_by_its_worker_and_the_time_held_is_its_pause(monkeypatch):
    """Asked first without a hold (a refusal may move it to a replica with room), then with ``ROOM_HOLD_S``: the
    worker admits it when room frees, whoever frees it. The pause before asking again counts the time it was held,
    so after a hold it asks again at once; an older worker that refuses at once is asked after the usual pause."""
    monkeypatch.setattr(failover, "KV_BACKOFF_S", 0.2)
    pauses = []
    pause = failover._Wait.pause

    async def noted(self, backoff_s):
        pauses.append(backoff_s)
        return await pause(self, backoff_s)

    monkeypatch.setattr(failover._Wait, "pause", noted)
    state = RequestState(list(PROMPT), SamplingParams(), StopConditions(40))
    full = Holding("full", [KVCacheExhaustedError("full")] * 2, held_s=0.65)
    assert asyncio.run(verifier(full, Spares(targets=[full] * 2), state).prefill("s", PROMPT, state.sampling)) \
        == Prefilled(9)
    assert full.holds == [0.0, failover.ROOM_HOLD_S, failover.ROOM_HOLD_S]
    assert pauses[0] > 0 and pauses[1] == 0.0  # held 0.65 s, past its longest pause then (0.4 s x 1.5)
    # a preempted request's rebuild asks to be held too
    state, full = request(), Holding("full", [KVCacheExhaustedError("full"), None])
    asyncio.run(verifier(full, Spares(targets=[full]), state).verify("s", len(state.history), [4], []))
    assert full.holds == [failover.ROOM_HOLD_S] and full.released == ["s"]


def test_a_coordinator_may_ask_for_another_hold_or_none(monkeypatch):
    """``room_hold_s`` (``--room-hold``) is what every Prefill after a refusal asks for; 0: refused at once each time,
    the request paused between asks as before holds existed."""
    monkeypatch.setattr(failover, "KV_BACKOFF_S", 0.001)
    for hold in (0.0, 0.25):
        state = RequestState(list(PROMPT), SamplingParams(), StopConditions(40))
        full = Holding("full", [KVCacheExhaustedError("full")] * 2, held_s=0.0)
        chosen = FailoverVerifier(full, Spares(targets=[full] * 2), state, lambda target: 3, room_hold_s=hold)
        assert asyncio.run(chosen.prefill("s", PROMPT, state.sampling)) == Prefilled(9)
        assert full.holds == [0.0, hold, hold]


def test_the_time_a_worker_held_a_prefill_counts_toward_the_longest_wait(monkeypatch):
    monkeypatch.setattr(failover, "KV_BACKOFF_S", 0.001)
    monkeypatch.setattr(failover, "KV_WAIT_MAX_S", 0.25)
    state = RequestState(list(PROMPT), SamplingParams(), StopConditions(40))
    full = Holding("full", [KVCacheExhaustedError("full")] * 1000, held_s=0.3)
    with pytest.raises(KVCacheExhaustedError):
        asyncio.run(verifier(full, Spares(targets=[full] * 1000), state).prefill("s", PROMPT, state.sampling))
    assert len(full.holds) == 2  # refused at once, then held past the longest wait: given up


def test_without_a_spare_or_past_the_longest_wait_the_error_reaches_the_caller(monkeypatch):
    state = request()
    with pytest.raises(WorkerUnavailableError, match="gone"):
        asyncio.run(verifier(Replica("t", [WorkerUnavailableError("gone")]), Spares(), state).verify("s", 7, [], []))
    assert state.stats.target_moves == 0
    monkeypatch.setattr(failover, "KV_BACKOFF_S", 0.001)
    monkeypatch.setattr(failover, "KV_WAIT_MAX_S", 0.005)
    full = Replica("full", [KVCacheExhaustedError("full")] * 1000)
    with pytest.raises(KVCacheExhaustedError):
        asyncio.run(verifier(full, Spares(targets=[full] * 1000), state).verify("s", 7, [], []))
    assert 0 < state.stats.preemptions < 1000


class Tally:
    """The waiting tally (``failover.Tally``), and the value each replica call saw."""

    def __init__(self) -> None:
        self.value, self.seen = 0, []

    def inc(self) -> None:
        self.value += 1

    def dec(self) -> None:
        self.value -= 1


class Watched(Replica):
    """A replica that notes the tally's value at each call."""

    def __init__(self, name: str, tally: Tally, errors=()) -> None:
        super().__init__(name, errors)
        self.tally = tally

    def _answer(self, call: tuple) -> None:
        self.tally.seen.append((call[0], self.tally.value))
        super()._answer(call)


def test_a_request_counts_as_waiting_from_its_first_refusal_or_fault_until_its_call_is_served(monkeypatch):
    """The coordinator's queue (vllm:num_requests_waiting): a call refused for room, preempted or moved after a
    fault is counted once while it waits and its rebuild runs, and no longer once served or given up."""
    monkeypatch.setattr(failover, "KV_BACKOFF_S", 0.001)
    tally = Tally()
    state = request()
    full = Watched("full", tally, [None, KVCacheExhaustedError("full"), KVCacheExhaustedError("full")])
    wrapped = FailoverVerifier(full, Spares(targets=[full] * 2), state, lambda _: 0, waiting=tally)
    asyncio.run(wrapped.verify("s", len(state.history), [4], []))  # served at once: never waiting
    assert state.stats.queue_s == 0
    asyncio.run(wrapped.verify("s", len(state.history), [4], []))  # preempted, its rebuild refused, then served
    assert tally.seen == [("verify", 0), ("verify", 0), ("prefill", 1), ("prefill", 1), ("verify", 1)]
    assert tally.value == 0
    assert state.stats.queue_s >= 0.001  # two backoffs of at least half of KV_BACKOFF_S, then 2x that
    dying, spare = Watched("dying", tally, [WorkerUnavailableError("gone")]), Watched("spare", tally)
    wrapped = FailoverVerifier(dying, Spares(targets=[spare]), request(), lambda _: 0, waiting=tally)
    asyncio.run(wrapped.verify("s", 7, [], []))
    assert tally.seen[-3:] == [("verify", 0), ("prefill", 1), ("verify", 1)] and tally.value == 0
    monkeypatch.setattr(failover, "KV_WAIT_MAX_S", 0.005)  # given up: no longer waiting either
    full = Watched("full", tally, [KVCacheExhaustedError("full")] * 1000)
    with pytest.raises(KVCacheExhaustedError):
        asyncio.run(FailoverVerifier(full, Spares(targets=[full] * 1000), request(), lambda _: 0,
                                     waiting=tally).prefill("s", PROMPT, SamplingParams()))
    assert max(value for _, value in tally.seen) == 1 and tally.value == 0


def test_an_error_that_is_no_replica_fault_is_not_survived():
    state = request()
    spares = Spares(targets=[Replica("spare")])
    with pytest.raises(InvalidRequestError):
        asyncio.run(verifier(Replica("t", [InvalidRequestError("bad")]), spares, state).verify("s", 7, [], []))
    assert spares.asked == [] and state.stats.target_moves == 0


def test_the_load_and_cost_are_the_current_replicas():
    state = request()
    first, spare = Replica("first", [WorkerUnavailableError("gone")], cost=0.1, streams=3), Replica("s", cost=0.5)
    wrapped = verifier(first, Spares(targets=[spare]), state)
    assert wrapped.streams == 3 and wrapped.fitted_cost() == FittedCost(0.1, 0.001)
    asyncio.run(wrapped.verify("s", len(state.history), [], []))
    assert wrapped.streams == 1 and wrapped.fitted_cost() == FittedCost(0.5, 0.001)


# ----- the draft -------------------------------------------------------------------------------------------

def propose(draft: FailoverDraft, committed_len: int = 0, k: int = 2) -> Drafted:
    return asyncio.run(draft.propose("s", committed_len, [1, 2], k, SamplingParams()))


def test_a_failed_draft_gives_up_on_the_call_and_the_next_goes_to_its_replacement(caplog):
    caplog.set_level(logging.INFO, logger="tandem.spec.failover")
    stats = GenerationStats()
    dying, spare = Replica("dying", [WorkerUnavailableError("gone")]), Replica("spare")
    draft = FailoverDraft(dying, Spares(drafts=[spare]), stats)
    assert propose(draft) == Drafted([], lost=True, gone=False)
    assert stats.draft_moves == 1 and dying.released == ["s"]
    assert "request s lost its draft replica: it goes on with another (spare)" in caplog.text
    assert propose(draft, committed_len=0) == Drafted([7, 7])
    assert spare.calls == [("propose", 0, [1, 2], 2)] and draft.fitted_cost() == spare.fitted_cost()
    asyncio.run(draft.release("s"))
    assert spare.released == ["s"]


def test_with_no_draft_left_every_call_says_so_and_nothing_is_asked_again(caplog):
    caplog.set_level(logging.INFO, logger="tandem.spec.failover")
    stats = GenerationStats()
    dying = Replica("dying", [InternalError("restarted")])
    spares = Spares()
    draft = FailoverDraft(dying, spares, stats)
    assert propose(draft) == Drafted([], lost=True, gone=True)
    assert propose(draft) == Drafted([], lost=True, gone=True)
    assert len(dying.calls) == 1 and spares.asked == [("draft", True)] and stats.draft_moves == 1
    assert "request s lost its draft replica: it goes on with n-gram proposals alone" in caplog.text
    assert draft.fitted_cost() is None
    asyncio.run(draft.release("s"))
    assert dying.released == ["s"]  # once, when it was left


def test_a_full_draft_pool_skips_that_call_alone():
    stats = GenerationStats()
    full = Replica("full", [KVCacheExhaustedError("full")])
    spares = Spares(drafts=[Replica("spare")])
    draft = FailoverDraft(full, spares, stats)
    assert propose(draft) == Drafted([], lost=True, gone=False)
    assert propose(draft) == Drafted([7, 7])
    assert spares.asked == [] and stats.draft_moves == 0 and len(full.calls) == 2


def test_a_request_that_outgrows_the_drafts_whole_pool_leaves_it_for_good():
    """A draft on a smaller GPU than the target's: once the sequence is longer than the draft's pool could ever
    hold, every call would be refused as full. The draft is released and left, without a call, and no spare is
    asked for; a sequence that still fits is drafted as before."""
    stats = GenerationStats()
    small = Replica("small")
    small.room = 6
    spares = Spares(drafts=[Replica("spare")])
    draft = FailoverDraft(small, spares, stats)

    async def go():
        calls = [(4, [1, 2]), (5, [1, 2]), (0, [1])]  # 4 + 2 tokens fit exactly; 7 never again, nor anything after
        answers = [await draft.propose("s", held, new, 2, SamplingParams()) for held, new in calls]
        await asyncio.sleep(0.01)  # (the release runs in the background)
        await draft.release("s")  # nothing more to release
        return answers
    assert asyncio.run(go()) == [Drafted([7, 7]), Drafted([], lost=True, gone=True), Drafted([], lost=True, gone=True)]
    assert len(small.calls) == 1 and small.released == ["s"]
    assert spares.asked == [] and stats.draft_moves == 0
    never_asked = Replica("never asked")
    never_asked.room = 1
    assert propose(FailoverDraft(never_asked, Spares(), GenerationStats())) == Drafted([], lost=True, gone=True)
    assert never_asked.released == [] and never_asked.calls == []  # it held nothing: nothing to release


def test_a_replacement_that_was_never_asked_is_not_released():
    dying, spare = Replica("dying", [WorkerUnavailableError("gone")]), Replica("spare")
    draft = FailoverDraft(dying, Spares(drafts=[spare]), GenerationStats())
    propose(draft)
    asyncio.run(draft.release("s"))
    assert spare.released == [] and spare.calls == []


def test_calls_that_fail_together_replace_the_draft_once():
    stats = GenerationStats()
    dying = Replica("dying", [WorkerUnavailableError("gone"), WorkerUnavailableError("gone")])
    spares = Spares(drafts=[Replica("spare"), Replica("another")])
    draft = FailoverDraft(dying, spares, stats)

    async def both():
        return await asyncio.gather(draft.propose("s", 0, [1], 2, SamplingParams()),
                                    draft.propose("s", 1, [2], 2, SamplingParams()))

    assert asyncio.run(both()) == [Drafted([], lost=True)] * 2
    assert stats.draft_moves == 1 and spares.asked == [("draft", True)] and draft.channel.name == "spare"


@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_a_request_whose_draft_is_gone_goes_on_with_ngram_proposals(method):
    state = RequestState(list(PROMPT), SamplingParams(), StopConditions(80))
    dying = DyingDraft(calls=2)
    draft = FailoverDraft(dying, Spares(), state.stats)
    loop = SpeculationLoop(state, "s", SpecOptions(method, 3, adaptive_k=False), FakeTarget(), draft, CostModel(),
                           10_000)
    asyncio.run(loop.run_to_end())
    assert state.generated == target_only(PROMPT, 80)
    assert loop.draft is None and dying.calls_left == -1
    assert state.stats.ngram_rounds > 0  # the n-gram lookup took over (a draft request has none otherwise)


class SlowRelease(Replica):
    """A replica whose Release takes a moment, as one queued behind other calls on a worker does."""

    async def release(self, seq_id):
        await asyncio.sleep(0.01)
        self.released.append(seq_id)

    async def prefill(self, seq_id, token_ids, sampling, prompt_len=0, propose=0, wait_for_room_s=0.0):
        self.calls.append(("released before this prefill", list(self.released)))
        return await super().prefill(seq_id, token_ids, sampling, prompt_len, propose)


def test_a_request_moved_back_to_the_same_worker_is_released_there_before_the_call_is_repeated(caplog):
    # A worker taken for hung (only slow) is healthy again by the time the request moves: the move picks it. Its
    # release must come first, or it could free the sequence the repeated Prefill makes there.
    caplog.set_level(logging.INFO, logger="tandem.spec.failover")
    state = RequestState(list(PROMPT), SamplingParams(), StopConditions(40))
    slow = SlowRelease("slow", [WorkerUnavailableError("did not answer in time")])
    wrapped = verifier(slow, Spares(targets=[slow]), state)
    assert asyncio.run(wrapped.prefill("s", PROMPT, state.sampling)) == Prefilled(9)
    assert slow.calls[-2:] == [("released before this prefill", ["s"]), ("prefill", PROMPT, 0, 0)]
    assert state.stats.target_moves == 1
    assert "request s moves back to the same target replica (slow)" in caplog.text
