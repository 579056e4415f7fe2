"""Predicted outputs (``tandem.spec.prediction``): what the index proposes, and that a prediction changes how
fast an answer comes, never what it is."""

from __future__ import annotations

import random

import pytest

from tandem.errors import InvalidRequestError
from tandem.inprocess import GenerationRequest, SpeculativeGenerator
from tandem.sampling import SamplingParams
from tandem.spec.options import SpecOptions
from tandem.spec.prediction import PROMPT_CONTEXT, PredictionIndex
from tests.spec.test_greedy_equivalence import load

PROMPT = [5, 17, 33, 2, 40]
N = 40


# ----- the index -----------------------------------------------------------------------------------------------
def test_the_first_round_proposes_the_prediction_s_start_across_the_prompt_boundary():
    index = PredictionIndex([1, 2, 3, 4], [10, 11, 12, 13])
    assert index.lookup([1, 2, 3, 4], 3, 1, 4) == ([10, 11, 12], 4)
    assert len(index) == 4


def test_only_the_prediction_is_proposed_never_the_prompt():
    # (7, 8) occurs in the prompt's tail, followed by 9: that is not a prediction token, so nothing is proposed.
    index = PredictionIndex([7, 8, 9, 1], [20, 21])
    assert index.lookup([0, 7, 8], 2, 1, 2) == ([], 0)


def test_the_longest_suffix_wins_and_a_history_without_one_gets_nothing():
    index = PredictionIndex([0], [1, 2, 3, 9, 2, 3, 4])
    assert index.lookup([5, 9, 2, 3], 2, 1, 4) == ([4], 3)  # (9, 2, 3): only before 4, not (2, 3)'s first
    assert index.lookup([5, 6], 2, 1, 4) == ([], 0)
    assert index.lookup([5, 9, 2, 3], 0, 1, 4) == ([], 0)


def test_proposals_move_forward_through_a_repeated_line():
    """A line that occurs twice: the answer's second copy of it is continued from the second; once nothing lies
    ahead (the answer repeats the line a third time), from the last occurrence before."""
    line, first_end, second_end = [5, 6], [7, 8], [9, 9]
    prediction = [*line, *first_end, *line, *second_end]
    index = PredictionIndex([0], prediction)
    assert index.lookup([0, 5, 6], 2, 1, 2) == ([7, 8], 2)
    assert index.lookup([0, 5, 6, 7, 8, 5, 6], 2, 1, 2) == ([9, 9], 2)  # not (5, 6)'s first occurrence again
    assert index.lookup([0, 5, 6, 7, 8, 5, 6, 9, 9, 1, 5, 6], 2, 1, 2) == ([9, 9], 2)


def test_after_an_edit_proposals_resume_where_the_answer_meets_the_prediction_again():
    prediction = list(range(100, 130))
    index = PredictionIndex([0], prediction)
    edited = [0, *prediction[:10], 7, 7, 7]  # the answer inserted text of its own
    assert index.lookup(edited, 4, 1, 3) == ([], 0)
    resumed = [*edited, *prediction[10:12]]
    assert index.lookup(resumed, 4, 1, 3) == (prediction[12:16], 2)


def test_the_prompt_context_is_a_few_tokens_of_the_prompt_s_end():
    prompt = list(range(50, 50 + 3 * PROMPT_CONTEXT))
    index = PredictionIndex(prompt, [1, 2])
    assert index.lookup(prompt, 2, 1, PROMPT_CONTEXT) == ([1, 2], PROMPT_CONTEXT)
    with pytest.raises(ValueError, match="empty prediction"):
        PredictionIndex(prompt, [])


# ----- the loop: the same answer, sooner where it copies the prediction ------------------------------------------
@pytest.fixture(scope="module")
def target(tiny_qwen2_dir):
    return load(tiny_qwen2_dir)


@pytest.fixture(scope="module")
def draft(tiny_qwen2_other_dir):
    return load(tiny_qwen2_other_dir)  # another random model: its drafts are mostly wrong


def generate(target, draft=None, method="none", prediction=(), sampling=None, k=4, adaptive=True,
             generator=None):
    spec = SpecOptions(method, k if method != "none" else 0, adaptive)
    generator = generator or SpeculativeGenerator(target, draft, spec)
    request = GenerationRequest(PROMPT, max_new_tokens=N, sampling=sampling or SamplingParams(),
                                prediction_ids=list(prediction))
    return generator.generate([request])[0]


@pytest.fixture(scope="module")
def plain(target):
    return generate(target).token_ids


def predictions(answer: list[int]) -> dict[str, list[int]]:
    rng = random.Random(0)
    edited = [*answer[:12], 3, 3, 3, *answer[12:25], *answer[30:]]  # an insertion and a deletion
    return {"exact": answer, "edited": edited, "unrelated": [rng.randrange(90) for _ in range(60)]}


@pytest.mark.parametrize("kind", ["exact", "edited", "unrelated"])
@pytest.mark.parametrize("method", ["ngram", "hybrid", "draft"])
def test_greedy_output_is_target_only_s_whatever_the_prediction(target, draft, plain, method, kind):
    uses_draft = method != "ngram"
    result = generate(target, draft if uses_draft else None, method, predictions(plain)[kind])
    assert result.token_ids == plain
    assert target.kv_cache.num_free_blocks == target.kv_cache.num_blocks  # released
    if kind == "exact":  # the answer copies it: most of it comes from the prediction, in few rounds
        assert result.stats.prediction_accepted >= 0.6 * N, result.stats.as_dict()
        assert result.stats.rounds <= N // 3, result.stats.as_dict()
    if kind == "unrelated":
        assert result.stats.prediction_accepted <= 0.1 * N


def test_the_prediction_is_what_speeds_the_answer(target, plain):
    """Without it, n-gram lookup over the prompt finds nothing like the answer; with it, rounds commit many
    tokens each (an index that proposed nothing, or a loop that ignored it, fails here)."""
    without = generate(target, None, "ngram")
    with_it = generate(target, None, "ngram", plain)
    assert without.token_ids == with_it.token_ids == plain
    assert without.stats.rounds >= N - 5 and with_it.stats.rounds <= N // 3
    assert "prediction_accepted" not in without.stats.as_dict()


def test_a_fixed_k_is_the_request_s_and_adaptive_rounds_verify_longer_runs(target, plain):
    fixed = generate(target, None, "ngram", plain, k=2, adaptive=False)
    assert fixed.token_ids == plain
    assert max(fixed.stats.k_counts) == 2
    adaptive = generate(target, None, "ngram", plain, k=2)
    assert adaptive.token_ids == plain
    assert max(adaptive.stats.k_counts) > 2  # a prediction's own cap (up to MAX_K), not the request's default


def test_plain_decoding_ignores_a_prediction(target, plain):
    result = generate(target, None, "none", plain)
    assert result.token_ids == plain and result.stats.drafted == 0 and result.stats.rounds == N - 1


def test_a_seeded_answer_is_its_plain_seeded_answer_with_a_prediction(target):
    """Sampling: a prediction is a deterministic proposal, verified as any other; a seeded request's tokens are
    its plain seeded draws (the coupling of tandem/spec/rejection.py), so the answer is exactly the same."""
    sampling = SamplingParams(temperature=0.9, seed=11)
    plain_sampled = generate(target, sampling=sampling).token_ids
    result = generate(target, None, "ngram", plain_sampled, sampling=sampling)
    assert result.token_ids == plain_sampled
    assert result.stats.prediction_accepted > 0


def test_a_prediction_past_the_vocabulary_is_refused_naming_it(target):
    with pytest.raises(InvalidRequestError, match="prediction: token ids"):
        generate(target, None, "ngram", [1, 2, 10**9])
