"""The chi-square helper's pooling of rare outcomes (tests/spec/losslessness.py): the bin it pools them into must
itself expect 5 or more, or a correct sampler fails. The first H200 run of the GPU check failed so (2026-12-04):
2 draws where 0.2 were expected read as p = 8e-5, while the exact chance of 2 or more is 1.8 %."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare, poisson

from tests.spec.losslessness import SIGNIFICANCE, chi_square_pvalue, pooled

# Two rare outcomes (0.1 expected each in 4000 draws), one of 6, and the rest.
LAW = np.array([0.1, 0.1, 6.0, 3993.8]) / 4000


def draws(counts: list[int]) -> list[int]:
    return [outcome for outcome, n in enumerate(counts) for _ in range(n)]


def test_rare_outcomes_are_pooled_until_the_pool_expects_five():
    observed, expected = pooled(np.array([1, 1, 6, 3992]), LAW * 4000)
    assert expected.tolist() == pytest.approx([3993.8, 6.2])  # the 6 taken in beside the two of 0.1
    assert observed.tolist() == [3992, 8]


def test_two_draws_of_outcomes_expected_twice_in_a_hundred_do_not_fail_a_correct_sampler():
    samples = draws([1, 1, 6, 3992])
    assert poisson.sf(1, 0.2) > 0.01  # 2 or more where 0.2 are expected: not rare
    # What pooling the two rare outcomes alone gave: a false alarm.
    assert chisquare([2, 6, 3992], [0.2, 6.0, 3993.8]).pvalue < SIGNIFICANCE
    assert chi_square_pvalue(samples, LAW) > SIGNIFICANCE


def test_an_excess_in_the_pooled_outcomes_is_still_caught():
    assert chi_square_pvalue(draws([10, 10, 6, 3974]), LAW) < SIGNIFICANCE


def test_a_law_too_concentrated_to_test_with_these_draws_is_refused_rather_than_judged():
    with pytest.raises(ValueError, match="too few samples for a chi-square test: 4000 over 3 outcomes"):
        chi_square_pvalue(draws([3999, 1, 0]), np.array([0.9999, 0.00005, 0.00005]))
