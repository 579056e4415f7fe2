"""What every proposer takes and returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence

import torch

from tandem.sampling import SamplingParams


@dataclass(slots=True)
class ProposeRequest:
    """Draft up to ``k`` tokens to follow ``tokens`` (the sequence's whole committed history)."""

    seq_id: Hashable
    tokens: Sequence[int]  # prompt + every token committed so far
    k: int
    sampling: SamplingParams
    generator: torch.Generator | None = None  # the request's own; used when sampling


@dataclass(slots=True)
class Proposal:
    """Draft tokens and, for sampled requests, the distributions they were drawn from.

    ``probs is None`` means the proposal is deterministic (a point mass on each
    token: greedy drafting or an n-gram match); the rejection sampler treats
    that as q = one-hot, which is exact.
    """

    tokens: list[int]  # [k'] with k' <= k (an n-gram match may be shorter, or empty)
    probs: torch.Tensor | None = None  # [k', vocab] float32: q, exactly as sampled from


class Proposer(Protocol):
    """Guesses the next tokens of many sequences at once."""

    name: str

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        """One proposal per request, in order."""

    def release(self, seq_id: Hashable) -> None:
        """Forget a finished sequence (free its draft KV)."""
