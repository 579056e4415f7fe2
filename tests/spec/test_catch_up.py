"""The loop's choice of k: drafting must repay feeding a draft that was left out."""

from __future__ import annotations

from tandem.sampling_params import SamplingParams
from tandem.spec.adaptive import CostModel
from tandem.spec.loop import SpeculationLoop
from tandem.spec.options import SpecOptions
from tandem.spec.request import RequestState, StopConditions
from tandem.spec.transport import FittedCost


class Worker:
    """Only what k is chosen from: the worker's fitted forward cost and how many streams share it."""

    def __init__(self, base_s: float, per_token_s: float, streams: int) -> None:
        self.cost, self.streams = FittedCost(base_s, per_token_s), streams

    def fitted_cost(self) -> FittedCost:
        return self.cost


def loop_with(streams: int, prompt_len: int = 300, max_new: int = 100) -> SpeculationLoop:
    state = RequestState(list(range(1, prompt_len + 1)), SamplingParams(), StopConditions(max_new))
    # Costs measured on the benchmark machine: Qwen 1.5B target, int8 Qwen 0.5B draft.
    target, draft = Worker(0.13, 0.006, streams), Worker(0.016, 0.005, streams)
    loop = SpeculationLoop(state, "s", SpecOptions("draft", 4), target, draft, CostModel(), max_context=32768)
    state.tracker.accepted, state.tracker.rejected = 30.0, 3.0  # a request whose drafts mostly land
    return loop


def test_a_lone_stream_drafts_from_its_first_round():
    assert loop_with(streams=1)._choose_k(after_tokens=0) > 0


def test_under_load_a_stream_does_not_start_a_draft_that_cannot_repay_its_prefill():
    busy = loop_with(streams=3, max_new=50)
    assert busy._choose_k(after_tokens=0) == 0  # 300 prompt tokens to feed, charged to 3 streams
    busy.draft.sent = list(busy.state.history)  # the draft already holds the sequence
    assert busy._choose_k(after_tokens=0) > 0


def test_near_its_end_a_stream_under_load_does_not_restart_drafting():
    ending = loop_with(streams=2, max_new=3)
    assert ending._choose_k(after_tokens=0) == 0
    ending.draft.sent = list(ending.state.history)
    assert ending._choose_k(after_tokens=0) > 0
