"""Prompt lookup and the adaptive-k rule."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.errors import InvalidRequestError
from tandem.spec.adaptive import (
    MATCH_MEMORY,
    MAX_STOP_BELOW,
    AcceptanceTracker,
    CostModel,
    MatchRates,
    choose_k,
    expected_tokens,
    match_band,
    stop_below,
)
from tandem.spec.ngram import lookup_continuation, lookup_match
from tandem.spec.options import SpecOptions
from tandem.spec.proposers import ngram_proposal


def lookup(tokens, k=3, min_n=1, max_n=3):
    return lookup_continuation(np.array(tokens), k, min_n, max_n)


def test_longest_suffix_match_wins():
    # suffix [1, 2] occurs at 0 (followed by 9) and, as bigram [2] alone, at 5 (followed by 7)
    assert lookup([1, 2, 9, 8, 0, 2, 7, 1, 2], k=2) == [9, 8]


def test_most_recent_occurrence_is_used():
    assert lookup([4, 5, 1, 4, 6, 2, 4], k=1, max_n=1) == [6]


def test_no_match_and_short_continuations():
    assert lookup([1, 2, 3, 4]) == []
    assert lookup([7, 3, 7], k=5) == [3, 7]  # only what exists is proposed
    assert lookup([5]) == []


def test_proposal_respects_k_zero_and_sizes_are_validated():
    assert lookup_match([1, 2, 1], 0, 1, 2) == ([], 0)
    proposal, matched = ngram_proposal([1, 2, 1], 2, 1, 2)
    assert (proposal.tokens, matched, proposal.base_len) == ([2, 1], 1, 3)
    with pytest.raises(InvalidRequestError, match="min <= max"):
        SpecOptions("ngram", ngram_min=3, ngram_max=2)


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_choose_k_backs_off_when_drafts_are_wrong_or_expensive():
    cheap = CostModel(draft_step_s=0.05, verify_base_s=1.0)
    assert choose_k(0.9, cheap, 8) >= 4
    assert choose_k(0.05, cheap, 8) == 0
    costly = CostModel(draft_step_s=1.5, verify_base_s=1.0)
    assert choose_k(0.8, costly, 8) == 0


def test_tracker_learns_acceptance_rate():
    tracker = AcceptanceTracker()
    for _ in range(50):
        tracker.observe(4, 0)
    assert tracker.rate < 0.1
    tracker = AcceptanceTracker()
    for _ in range(50):
        tracker.observe(4, 4)
    assert tracker.rate > 0.95


def test_match_rates_learn_each_kind_of_evidence_apart():
    rates = MatchRates()
    fresh = AcceptanceTracker().rate
    for _ in range(40):
        rates.observe("ngram", 1, True, 4, 0)  # one-token matches of the request's text: always wrong
        rates.observe("cache", 9, True, 4, 4)  # long cache matches: always right
    assert rates.rate("ngram", 1, True) < 0.1
    assert rates.rate("cache", 8, True) > 0.95  # 8 and 9 share the last band
    assert rates.rate("ngram", 1, False) == fresh  # greedy requests learn apart from sampled ones
    assert rates.rate("cache", 1, True) == fresh  # a short cache match is another kind
    assert rates.rate("ngram", 2, True) == fresh


def test_match_bands_and_memory():
    assert [match_band(n) for n in (1, 2, 3, 4, 5, 7, 8, 30)] == [1, 2, 4, 4, 7, 7, 8, 8]
    rates = MatchRates()
    for _ in range(1000):
        rates.observe("cache", 3, False, 4, 4)
    assert rates.rate("cache", 3, False) > 0.99
    for _ in range(60):  # the workload changes: a bounded memory follows it within a few hundred rounds
        rates.observe("cache", 3, False, 4, 0)
    tracker = rates.trackers[("cache", 4, False)]
    assert tracker.accepted + tracker.rejected <= MATCH_MEMORY + 4
    assert rates.rate("cache", 3, False) < 0.9


def test_cost_model_follows_measurements():
    costs = CostModel()
    for _ in range(30):
        costs.observe_draft(0.02)
        costs.observe_verify(5, 0.2)
    assert costs.draft_step_s == pytest.approx(0.02, rel=0.01)
    assert costs.round_seconds(4) == pytest.approx(4 * 0.02 + 0.2, rel=0.05)


def test_first_measurements_keep_speculation_worthwhile():
    """Regression: the first verify measurement once drove the base cost to ~0 and k to 0 for good."""
    costs = CostModel()
    costs.observe_draft(0.0001)
    costs.observe_verify(5, 0.03)
    assert choose_k(0.95, costs, 8) >= 4


def test_forward_cost_fit_recovers_a_line():
    from tandem.cost_fit import ForwardCostFit

    fit = ForwardCostFit()
    for tokens in [1, 5, 9, 40, 128, 5, 1, 300, 9, 17] * 5:
        fit.observe(tokens, 0.12 + 0.002 * tokens)
    assert fit.base_s == pytest.approx(0.12, rel=1e-3)
    assert fit.per_token_s == pytest.approx(0.002, rel=1e-3)
    flat = ForwardCostFit()
    for _ in range(10):
        flat.observe(5, 0.1)  # no spread in batch sizes: no slope to trust
    assert flat.per_token_s == 0.0 and flat.base_s == pytest.approx(0.1)


def test_forward_cost_fit_keeps_its_slope_through_batches_of_one_size():
    """A heads loop verifies trees of one size for hundreds of rounds: the warm-up's slope is kept for it."""
    from tandem.cost_fit import ForwardCostFit

    fit = ForwardCostFit()
    for tokens in [32, 1, 1, 8, 1]:  # the engine's warm-up sizes
        fit.observe(tokens, 0.05 + 0.005 * tokens)
    assert fit.per_token_s == pytest.approx(0.005, rel=1e-3)
    for _ in range(500):
        fit.observe(9, 0.05 + 0.005 * 9)
    assert fit.last_per_token_s == pytest.approx(0.005, rel=1e-3)
    assert fit.last_base_s == pytest.approx(0.05, rel=1e-3)
    # Adaptive k still reads "not known" (0): a slope kept at k = 0 could never be corrected.
    assert fit.per_token_s == 0.0 and fit.base_s == pytest.approx(0.095, rel=1e-3)


def test_forward_cost_fit_forgets_a_line_measured_long_ago():
    """A warm-up that ran beside another worker fitted 102 ms a step; a pass a minute later, alone,
    takes 23 ms: the fit must follow it, not average it against fifty stale passes."""
    from tandem.cost_fit import ForwardCostFit

    now = [0.0]
    fit = ForwardCostFit(clock=lambda: now[0])
    for tokens in [32, 1, 1, 8, 1] * 10:  # back to back: 50 ms apart
        now[0] += 0.05
        fit.observe(tokens, 0.102 + 0.011 * tokens)
    assert fit.base_s == pytest.approx(0.102, rel=1e-3)
    now[0] += 60.0
    fit.observe(1, 0.029)
    assert fit.base_s == pytest.approx(0.029, rel=0.01)
    assert fit.last_per_token_s == pytest.approx(0.011, rel=1e-3)  # the heads' budget keeps the last slope

    steady = ForwardCostFit(clock=lambda: now[0])
    for _ in range(50):
        now[0] += 0.05
        steady.observe(1, 0.1)
    now[0] += 0.05
    steady.observe(1, 0.2)  # back to back, a pass weighs against the 50 before it decayed 0.98 each, as before
    past = 0.98 * sum(0.98**i for i in range(50))
    assert steady.base_s == pytest.approx((0.1 * past + 0.2) / (past + 1), rel=1e-6)


def test_forward_cost_fit_leaves_prefills_out():
    from tandem.cost_fit import ForwardCostFit

    fit = ForwardCostFit()
    for tokens in [1, 5, 9, 17, 33] * 5:
        fit.observe(tokens, 0.12 + 0.002 * tokens)  # weight-bound decode and verify batches
    fit.observe(2000, 12.0)  # a compute-bound prompt: 6 ms per token
    assert fit.per_token_s == pytest.approx(0.002, rel=1e-3)


def test_speculation_backs_off_when_many_streams_share_the_target():
    from tandem.spec.adaptive import LoadAwareCost

    # A memory-bound target: 120 ms to read the weights, 4 ms per token on top; a draft step 40 ms + 1 ms/token.
    costs = LoadAwareCost(CostModel(), streams=1, target_base_s=0.12, target_per_token_s=0.004,
                          draft_base_s=0.04, draft_per_token_s=0.001)
    alone = choose_k(0.8, costs, 8)
    costs.streams = 16
    crowded = choose_k(0.8, costs, 8)
    assert alone >= 2 and crowded <= 1


def test_under_load_drafting_must_promise_a_clear_gain():
    from tandem.spec.adaptive import LoadAwareCost

    # Drafting 1-2 tokens promises about 10% more at 8 streams: not enough to bet on under load.
    costs = LoadAwareCost(CostModel(), streams=8, target_base_s=0.13, target_per_token_s=0.006,
                          draft_base_s=0.016, draft_per_token_s=0.005)
    assert choose_k(0.75, costs, 4) == 0
    costs.margin_per_extra_stream = 0.0
    assert choose_k(0.75, costs, 4) > 0


def test_a_draft_on_the_target_s_device_is_charged_every_stream_s_steps_its_batches_do_not_share():
    """Two streams out of step on one CPU (measured: draft steps held 1.08 calls) pay two draft batches a step."""
    from tandem.spec.adaptive import LoadAwareCost

    costs = LoadAwareCost(CostModel(), streams=2, target_base_s=0.22, target_per_token_s=0.0005,
                          draft_base_s=0.1, draft_per_token_s=0.001)
    own_device = costs.draft_step_s()
    assert own_device == 0.1 + 0.001 * 2  # a device of its own: one step of both streams' batch
    assert choose_k(0.76, costs, 4) > 0
    costs.draft_shares_device, costs.draft_calls_per_batch = True, 1.0
    assert costs.draft_step_s() == (0.1 + 0.001) * 2  # two batches of one call, each taking the device
    assert choose_k(0.76, costs, 4) == 0
    costs.draft_calls_per_batch = 2.0  # streams in step: one batch of both, as on a device of its own
    assert costs.draft_step_s() == own_device
    costs.draft_calls_per_batch = 0.0  # not measured yet: taken as one call a batch
    assert costs.draft_step_s() == (0.1 + 0.001) * 2
    costs.streams = 1  # a lone stream shares its batches with no one
    assert costs.draft_step_s() == 0.1 + 0.001


def test_the_in_process_generator_seeds_an_unfitted_cost_fit(tiny_qwen2_dir):
    """As a worker does at start: without a fit, adaptive k and the heads' budget would plan blind."""
    from tandem.config import EngineConfig
    from tandem.engine import ModelEngine
    from tandem.inprocess import SpeculativeGenerator

    engine = ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype="float32", kv_cache_tokens=512, block_size=4))
    assert not engine.cost_fit.ready
    SpeculativeGenerator(engine)
    assert engine.cost_fit.ready
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks  # the scratch sequence is gone


def test_stop_below_weighs_one_more_drafted_token_against_its_price():
    """One more token costs a draft step and a row; it is worth it while P * acceptance, the chance it is kept,
    beats what that time brings at the round's pace."""
    costs = CostModel(draft_step_s=0.2, verify_base_s=1.0, verify_slope=0.0, draft_measured=True,
                      verify_measured=True)
    pace = expected_tokens(0.8, 3) / costs.round_seconds(3)
    assert stop_below(0.8, costs, 3) == pytest.approx(0.2 * pace / 0.8)
    assert 0.3 < stop_below(0.8, costs, 3) < 0.6
    assert stop_below(0.8, costs, 1) == 0.0  # a draft of one token has nothing to stop
    assert stop_below(0.0, costs, 3) == 0.0
    dear = CostModel(draft_step_s=5.0, verify_base_s=1.0, verify_slope=0.0, draft_measured=True,
                     verify_measured=True)
    assert stop_below(0.5, dear, 4) == MAX_STOP_BELOW  # never so high that every draft stops after one token
    cheap = CostModel(draft_step_s=0.01, verify_base_s=1.0, verify_slope=0.0, draft_measured=True,
                      verify_measured=True)
    assert stop_below(0.8, cheap, 3) < stop_below(0.8, costs, 3)  # a cheaper step drafts on further
