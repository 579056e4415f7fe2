"""Sampling parameters, logits processing and per-request random generators.

Greedy (temperature 0) is an argmax; otherwise logits go through temperature,
min-p, top-k and top-p, in that order (vLLM's), to a probability distribution. The draft and
the target apply the very same processing, which the rejection sampler needs
(p and q must be the processed distributions).
"""

from __future__ import annotations

import torch

from tandem.sampling_params import SamplingParams

__all__ = ["SamplingParams", "pick_tokens", "probabilities", "draw_coupled", "exponential_noise", "sample",
           "seeded_race"]


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[R, V]`` float32 logits -> ``[R, V]`` float32 probabilities after temperature, min-p, top-k, top-p.

    Greedy gives a one-hot at the argmax, so that the rejection sampler
    reduces to exact matching for greedy requests.
    """
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # Shift each row so its max is 0 first (softmax does not change): a tiny temperature (float32 goes
    # down to 1e-45) would otherwise overflow the logits to inf and every probability to NaN.
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if params.min_p > 0:
        # Each row's max logit is 0 now, so a token's probability relative to the most likely one's is
        # exp(logit): it stays when that is >= min_p (the most likely token always does). Compared as
        # probabilities, as vLLM does, so a ratio that rounds to 1 stays at min_p 1.
        logits = logits.masked_fill(logits.exp() < params.min_p, float("-inf"))
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


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


# SplitMix64 (Steele, Lea and Flood 2014): a counter-based generator whose every output is a pure function of
# its input, computed here with int64 tensor arithmetic (multiplication wraps, as uint64's does).
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


# On the CPU a seeded race hashes noise for the support alone when it holds under 1 / this of the row:
# gathering a sparse support costs more than hashing the whole row once it is large (measured).
SPARSE_RACE_SHARE = 8


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 bits (torch's ``>>`` is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def exponential_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard exponential noise, one value per (key, token id): ``keys`` ``[R]`` int64 and ``token_ids``
    ``[R, N]`` (or ``[1, N]``, shared) -> ``[R, N]`` float64, on their device.

    Each value is a hash of its key and token id (SplitMix64's finaliser): the same numbers on every device
    and in every process, drawn for the ids asked only. So a draft on a CPU and its target on a GPU race the
    same noise, and a draft computes it for its few candidate ids alone.
    """
    z = keys.long()[:, None] + (token_ids.long() + 1) * _GOLDEN  # [R, N]
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    uniform = (_shift_right(z, 11).double() + 0.5) * 2.0**-53  # (0, 1): 53 bits, never 0
    return -torch.log(uniform)


def seeded_race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` probabilities, ``[R]`` int64 noise keys -> ``[R]`` int64: each row's token ``argmax(p / E)``.

    E is standard exponential noise per token (``exponential_noise``), so the token is a draw from p (the
    exponential race, the Gumbel-max trick's other face). A seeded request draws every token so, keyed by its
    position (``SamplingParams.noise_key``): plain decoding and verification make the same draw there, and a
    draft that races its own q against the same noise draws the same token whenever q is near p (Gumbel-max
    coupling: ``draw_coupled``). On an accelerator computed for every id, nothing read back; on the CPU, where
    a read costs nothing, for the support alone when it is small (top-p, top-k: 0.3 ms instead of 1.5 ms for a
    351-token support of Qwen's 151,936 ids). A token of probability 0 never wins, so both give one token.
    """
    keys = keys.to(probs.device)
    if probs.device.type == "cpu" and int(torch.count_nonzero(probs)) * SPARSE_RACE_SHARE < probs.numel():
        rows, ids = probs.nonzero(as_tuple=True)  # [M] each, the support
        scores = torch.zeros(probs.shape, dtype=torch.float64, device=probs.device)  # [R, V]
        scores[rows, ids] = probs[rows, ids].double() / exponential_noise(keys[rows], ids[:, None])[:, 0]
        return scores.argmax(-1)
    ids = torch.arange(probs.shape[-1], device=probs.device)[None]  # [1, V]
    return (probs.double() / exponential_noise(keys, ids)).argmax(-1)


def draw_coupled(probs: torch.Tensor, token_ids: torch.Tensor, key: int) -> int:
    """An index into ``probs`` ``[N]`` (a distribution over ``token_ids`` ``[N]``), raced against the noise of
    ``key``: the token ``seeded_race`` draws from p with that key whenever ``probs`` is near p."""
    noise = exponential_noise(torch.tensor([key], device=probs.device), token_ids.to(probs.device)[None])[0]
    return int((probs.double() / noise).argmax())


def pick_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token for each row of ``[R, V]`` logits -> ``[R]`` int64; argmax fast path for greedy."""
    if params.is_greedy:
        return logits.argmax(-1)
    assert generator is not None, "sampling needs a generator"
    return sample(probabilities(logits, params), generator)
