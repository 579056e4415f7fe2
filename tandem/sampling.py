"""Sampling parameters, logits processing and per-request random generators.

Greedy (temperature 0) is an argmax; otherwise logits go through temperature,
top-k and top-p, in that order, to a probability distribution. The draft and
the target apply the very same processing, which the rejection sampler needs
(p and q must be the processed distributions).
"""

from __future__ import annotations

import torch

from tandem.sampling_params import SamplingParams

__all__ = ["SamplingParams", "pick_tokens", "probabilities", "draw_coupled", "race_noise", "sample"]


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[R, V]`` float32 logits -> ``[R, V]`` float32 probabilities after temperature, top-k, top-p.

    Greedy gives a one-hot at the argmax, so that the rejection sampler
    reduces to exact matching for greedy requests.
    """
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # Shift each row so its max is 0 first (softmax does not change): a tiny temperature (float32 goes
    # down to 1e-45) would otherwise overflow the logits to inf and every probability to NaN.
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [R, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row of ``[R, V]`` probabilities -> ``[R]`` int64."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def race_noise(vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """``[vocab_size]`` float32: the noise ``sample`` races a ``[1, vocab_size]`` row against.

    ``torch.multinomial`` draws one token as ``argmax(p / E)``, E standard exponential noise
    drawn from the generator for the row. A sampler that divides its own q by the same E
    (the same generator state) draws the token ``sample`` would draw from p whenever p and q
    agree enough (Gumbel-max coupling): what a seeded draft does so that the target keeps its
    draws (``tandem.spec.rejection``). Only the acceptance rests on this, never correctness;
    tests/spec/test_seeded_rounds.py checks that torch still draws this way.
    """
    return torch.empty(1, vocab_size, device=generator.device).exponential_(generator=generator)[0]


def draw_coupled(probs: torch.Tensor, token_ids: torch.Tensor, vocab_size: int, generator: torch.Generator) -> int:
    """An index into ``probs`` ``[N]`` (a distribution over ``token_ids`` ``[N]`` of a ``vocab_size``-token
    vocabulary), raced against ``race_noise``: the token ``sample`` draws from p with this generator
    state, whenever ``probs`` is near p."""
    noise = race_noise(vocab_size, generator)[token_ids.to(generator.device)]  # [N], on the generator's device
    return int((probs / noise.to(probs.device)).argmax())


def pick_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token for each row of ``[R, V]`` logits -> ``[R]`` int64; argmax fast path for greedy."""
    if params.is_greedy:
        return logits.argmax(-1)
    assert generator is not None, "sampling needs a generator"
    return sample(probabilities(logits, params), generator)
