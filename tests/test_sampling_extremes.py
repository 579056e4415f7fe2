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


@pytest.mark.parametrize("temperature", [float(np.float32(1e-45)), 0.5, 1.0, 1e30])
@pytest.mark.parametrize("min_p", [1e-30, 0.01, 0.5, 1.0])
def test_min_p_keeps_the_tokens_at_least_that_share_of_the_likeliest(temperature, min_p):
    """min-p after temperature (vLLM's order): a token stays iff its tempered probability is >= min_p times the
    likeliest's; what stays keeps its relative weight."""
    params = SamplingParams(temperature, min_p=min_p, seed=1)
    probs = probabilities(LOGITS, params)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))
    plain = probabilities(LOGITS, SamplingParams(temperature, seed=1)).double()
    kept = plain >= min_p * plain.amax(-1, keepdim=True) * (1 - 1e-6)
    assert torch.equal(probs > 0, kept & (plain > 0))
    expected = torch.where(kept, plain, 0.0)
    assert torch.allclose(probs.double(), expected / expected.sum(-1, keepdim=True), atol=1e-6)


@pytest.mark.parametrize("min_p", [-0.1, 1.5, math.nan])
def test_min_p_outside_0_1_is_refused(min_p):
    with pytest.raises(InvalidRequestError, match="min_p must be in"):
        SamplingParams(1.0, min_p=min_p)


def test_min_p_crosses_the_wire():
    from tandem.rpc.wire import sampling_from_proto, sampling_to_proto

    params = SamplingParams(0.75, top_k=20, min_p=0.25, seed=3)  # exact in float32, the wire's type
    assert sampling_to_proto(params).min_p == 0.25 and sampling_from_proto(sampling_to_proto(params)) == params
