"""The coordinator's choice of k: drafting must repay feeding a draft that was left out."""

from __future__ import annotations

from types import SimpleNamespace

from coordinator.session import Session, StopConditions
from coordinator.speculation import SpeculationRun
from tandem.sampling import SamplingParams
from tandem.spec.adaptive import CostModel


def worker(base_s: float, per_token_s: float, streams: int) -> SimpleNamespace:
    info = SimpleNamespace(forward_base_s=base_s, forward_per_token_s=per_token_s, active_sequences=streams)
    return SimpleNamespace(info=info, streams=streams, active=0)


def run_with(streams: int, prompt_len: int = 300, max_new: int = 100) -> SpeculationRun:
    session = Session("r", list(range(1, prompt_len + 1)), SamplingParams(),
                      StopConditions(max_new, frozenset(), ()), tokenizer=None, method="draft", k_max=4,
                      adaptive_k=True, pipelined=False)
    # Costs measured on this machine: Qwen 1.5B target, int8 Qwen 0.5B draft.
    target, draft = worker(0.13, 0.006, streams), worker(0.016, 0.005, streams)
    run = SpeculationRun(session, target, draft, CostModel(), None, (1, 4), max_context=32768)
    run.s.tracker.accepted, run.s.tracker.rejected = 30.0, 3.0  # a request whose drafts mostly land
    return run


def test_a_lone_stream_drafts_from_its_first_round():
    assert run_with(streams=1)._choose_k(after_tokens=0) > 0


def test_under_load_a_stream_does_not_start_a_draft_that_cannot_repay_its_prefill():
    busy = run_with(streams=3, max_new=50)
    assert busy._choose_k(after_tokens=0) == 0  # 300 prompt tokens to feed, charged to 3 streams
    busy.draft_history = list(busy.s.history)  # the draft already holds the sequence
    assert busy._choose_k(after_tokens=0) > 0


def test_near_its_end_a_stream_under_load_does_not_restart_drafting():
    ending = run_with(streams=2, max_new=3)
    assert ending._choose_k(after_tokens=0) == 0
    ending.draft_history = list(ending.s.history)
    assert ending._choose_k(after_tokens=0) > 0
