"""Extreme but valid sampling values give proper distributions; non-finite ones are refused (fuzz findings)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tandem.errors import InvalidRequestError
from tandem.sampling import pick_tokens, probabilities
from tandem.sampling_params import SamplingParams

LOGITS = torch.tensor([[10.0, 5.0, -3.0, 10.0, float("-inf")], [0.0, 0.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("temperature", [float(np.float32(1e-45)), float(np.float32(1e-40)), 1e-30, 1e-3, 1.0,
                                         1e30, float(np.float32(3.4e38))])
@pytest.mark.parametrize("top_p", [float(np.float32(1e-30)), 0.5, 1.0])
@pytest.mark.parametrize("top_k", [0, 1, 2**31 - 1])
def test_any_finite_positive_temperature_gives_a_distribution(temperature, top_p, top_k):
    params = SamplingParams(temperature, top_p, top_k, seed=1)
    probs = probabilities(LOGITS, params)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(2))
    assert probs[0, 4] == 0  # a -inf logit is never picked
    token = pick_tokens(LOGITS, params, params.make_generator())
    assert token[0].item() in (0, 1, 2, 3)
    if temperature < 1e-20:  # colder than any logit gap: only the top tokens remain
        assert probs[0, 1] == probs[0, 2] == 0


@pytest.mark.parametrize("temperature", [math.inf, math.nan, -math.inf, -1e-45])
def test_non_finite_or_negative_temperature_is_refused(temperature):
    with pytest.raises(InvalidRequestError, match="temperature must be >= 0 and finite"):
        SamplingParams(temperature)
