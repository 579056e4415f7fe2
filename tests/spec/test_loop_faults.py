"""The loop over failover channels survives its replicas: a target or draft that fails mid-request, a full KV pool.

The fakes are those of test_loop.py (each side checks every committed_len it
is sent against its own history), so a rebuilt replica that was fed wrongly
fails loudly; the output must still be the target's own sequence.
"""

from __future__ import annotations

import asyncio

import pytest

from tandem.errors import InternalError, KVCacheExhaustedError, WorkerUnavailableError
from tandem.sampling_params import SamplingParams
from tandem.spec import failover
from tandem.spec.adaptive import CostModel
from tandem.spec.failover import FailoverDraft, FailoverVerifier
from tandem.spec.loop import SpeculationLoop
from tandem.spec.options import SpecOptions
from tandem.spec.request import RequestState, StopConditions
from tests.spec.test_loop import FakeDraft, FakeTarget, target_only

PROMPT = [3, 1, 4, 1, 5]


class DyingTarget(FakeTarget):
    """Serves ``calls`` Verify calls, then fails every call with ``error``."""

    def __init__(self, calls: int, error: Exception) -> None:
        super().__init__()
        self.calls_left, self.error = calls, error
        self.prefills: list[list[int]] = []

    async def prefill(self, seq_id, token_ids, sampling, prompt_len=0, propose=0, wait_for_room_s=0.0):
        self.prefills.append(list(token_ids))
        assert prompt_len in (0, len(PROMPT))  # a rebuild says where the prompt ends
        if self.calls_left <= 0:
            raise self.error
        return await super().prefill(seq_id, token_ids, sampling, prompt_len)

    async def verify(self, seq_id, committed_len, draft_tokens, draft_probs, draft_parents=(), propose=0):
        self.calls_left -= 1
        if self.calls_left < 0:
            raise self.error
        return await super().verify(seq_id, committed_len, draft_tokens, draft_probs, draft_parents)


class RecordingTarget(FakeTarget):
    def __init__(self) -> None:
        super().__init__()
        self.prefills: list[list[int]] = []

    async def prefill(self, seq_id, token_ids, sampling, prompt_len=0, propose=0, wait_for_room_s=0.0):
        self.prefills.append(list(token_ids))
        assert prompt_len in (0, len(PROMPT))  # a rebuild says where the prompt ends
        return await super().prefill(seq_id, token_ids, sampling, prompt_len)


class Replicas:
    """A ReplicaSource over lists of spare replicas."""

    def __init__(self, targets=(), drafts=()) -> None:
        self.targets, self.drafts = list(targets), list(drafts)
        self.asked: list[tuple[str, bool]] = []

    async def replace_target(self, faulty):
        self.asked.append(("target", faulty))
        return self.targets.pop(0) if self.targets else None

    async def replace_draft(self):
        self.asked.append(("draft", True))
        return self.drafts.pop(0) if self.drafts else None


def run(options, target, draft, replicas, n=40):
    """The loop as the coordinator builds it: its channels wrapped over ``replicas`` (None: in process)."""
    state = RequestState(list(PROMPT), SamplingParams(), StopConditions(n))
    if replicas is not None:
        target = FailoverVerifier(target, replicas, state, rebuild_propose=lambda _: 0)
        draft = FailoverDraft(draft, replicas, state.stats) if draft is not None else None
    loop = SpeculationLoop(state, "s", options, target, draft, CostModel(), 10_000)
    asyncio.run(loop.run_to_end())
    return state


@pytest.mark.parametrize("error", [WorkerUnavailableError("gone"), InternalError("restarted")])
@pytest.mark.parametrize("pipelined", [False, True])
def test_a_target_that_fails_mid_request_is_replaced_and_rebuilt_from_the_history(error, pipelined):
    dying, spare = DyingTarget(calls=4, error=error), RecordingTarget()
    replicas = Replicas(targets=[spare])
    state = run(SpecOptions("draft", 3, adaptive_k=False, pipelined=pipelined), dying, FakeDraft(), replicas)
    assert state.generated == target_only(PROMPT, 40)  # no token lost, none repeated
    assert state.stats.target_moves == 1 and replicas.asked == [("target", True)]
    rebuilt = spare.prefills[0]
    assert rebuilt[: len(PROMPT)] == PROMPT and len(rebuilt) > len(PROMPT)  # the prompt and what was generated
    assert rebuilt == [*PROMPT, *state.generated][: len(rebuilt)]  # the history as it stood
    assert "s" in dying.released and spare.released == ["s"]


def test_a_target_that_fails_during_the_prefill_is_replaced_before_any_token():
    dying, spare = DyingTarget(calls=0, error=WorkerUnavailableError("gone")), RecordingTarget()
    state = run(SpecOptions("ngram", 3, adaptive_k=False), dying, None, Replicas(targets=[spare]))
    assert state.generated == target_only(PROMPT, 40)
    assert spare.prefills == [PROMPT] and state.stats.target_moves == 1


def test_without_a_replacement_the_fault_reaches_the_caller_after_releasing():
    dying, draft = DyingTarget(calls=2, error=WorkerUnavailableError("gone")), FakeDraft()
    replicas = Replicas()  # no spare, or the request moved too often
    with pytest.raises(WorkerUnavailableError, match="gone"):
        run(SpecOptions("draft", 3, adaptive_k=False), dying, draft, replicas)
    assert draft.released == ["s"]


def test_in_process_there_is_no_replica_source_and_faults_propagate():
    dying = DyingTarget(calls=2, error=WorkerUnavailableError("gone"))
    with pytest.raises(WorkerUnavailableError):
        run(SpecOptions("ngram", 3, adaptive_k=False), dying, None, None)


class DyingDraft(FakeDraft):
    def __init__(self, calls: int) -> None:
        super().__init__()
        self.calls_left = calls

    async def propose(self, seq_id, committed_len, new_tokens, k, sampling, alternatives=0, prompt_len=0,
                      verified_len=0, stop_below=0.0):
        self.calls_left -= 1
        if self.calls_left < 0:
            raise WorkerUnavailableError("draft gone")
        return await super().propose(seq_id, committed_len, new_tokens, k, sampling, alternatives, prompt_len)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_failed_draft_is_replaced_by_another_replica_which_gets_the_whole_history(pipelined):
    dying, spare = DyingDraft(calls=3), FakeDraft()
    state = run(SpecOptions("draft", 3, adaptive_k=False, pipelined=pipelined), FakeTarget(), dying,
                Replicas(drafts=[spare]))
    assert state.generated == target_only(PROMPT, 40)
    assert state.stats.draft_moves == 1 and spare.calls > 0
    # its first Propose carried everything (committed_len 0): FakeDraft asserts committed_len <= held
    assert spare.released == ["s"]


@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_with_no_draft_left_the_request_goes_on_with_ngrams(method):
    dying = DyingDraft(calls=2)
    state = run(SpecOptions(method, 3, adaptive_k=False), FakeTarget(), dying, Replicas(), n=60)
    assert state.generated == target_only(PROMPT, 60)
    assert state.stats.draft_moves == 1 and dying.calls_left == -1  # one failed call, none after it
    assert state.stats.rounds > 0


class FullTarget(FakeTarget):
    """Refuses ``refusals`` Verify calls for a full KV pool (after ``after`` served), then serves."""

    def __init__(self, after: int, refusals: int) -> None:
        super().__init__()
        self.after, self.refusals = after, refusals
        self.prefills: list[list[int]] = []

    async def prefill(self, seq_id, token_ids, sampling, prompt_len=0, propose=0, wait_for_room_s=0.0):
        self.prefills.append(list(token_ids))
        assert prompt_len in (0, len(PROMPT))  # a rebuild says where the prompt ends
        return await super().prefill(seq_id, token_ids, sampling, prompt_len)

    async def verify(self, seq_id, committed_len, draft_tokens, draft_probs, draft_parents=(), propose=0):
        if self.after > 0:
            self.after -= 1
        elif self.refusals > 0:
            self.refusals -= 1
            raise KVCacheExhaustedError("KV cache full")
        return await super().verify(seq_id, committed_len, draft_tokens, draft_probs, draft_parents)


def test_a_full_kv_pool_preempts_the_request_and_rebuilds_it_later(monkeypatch):
    monkeypatch.setattr(failover, "KV_BACKOFF_S", 0.001)
    target = FullTarget(after=3, refusals=2)
    replicas = Replicas(targets=[target, target])  # capacity: the same replica may be chosen again
    state = run(SpecOptions("draft", 3, adaptive_k=False), target, FakeDraft(), replicas)
    assert state.generated == target_only(PROMPT, 40)
    assert state.stats.preemptions == 2 and state.stats.target_moves == 0
    assert replicas.asked == [("target", False), ("target", False)]
    assert len(target.prefills) == 3  # the prompt, then a rebuild after each wait
    assert target.released.count("s") == 3  # freed at each refusal, and at the end


def test_a_pool_that_stays_full_ends_in_a_clear_error(monkeypatch):
    monkeypatch.setattr(failover, "KV_BACKOFF_S", 0.001)
    monkeypatch.setattr(failover, "KV_WAIT_MAX_S", 0.01)
    target = FullTarget(after=1, refusals=10**6)
    with pytest.raises(KVCacheExhaustedError):
        run(SpecOptions("draft", 3, adaptive_k=False), target, FakeDraft(), Replicas(targets=[target] * 100))
