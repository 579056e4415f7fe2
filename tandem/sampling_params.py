"""A request's sampling parameters: plain data, torch-free (the coordinator validates them too)."""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.errors import InvalidRequestError

MAX_LOGPROBS = 20  # most alternatives per position a request may ask the target's log-probabilities of

if TYPE_CHECKING:
    import torch


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request picks its tokens. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    # The target's log-probabilities of the emitted tokens, with this many top alternatives each; None: none.
    # Reported only: it changes no token.
    logprobs: int | None = None
    # A seeded request is verified by the target's own seeded draw per position (tandem.spec.rejection,
    # "Seeded sampling"); True: by the rejection rule, as an unseeded one (its statistical tests ask this).
    rejection_rule: bool = False

    @property
    def exact_seed(self) -> bool:
        """Whether verification keeps the target's own seeded draw at each position (sampled and seeded)."""
        return self.seed is not None and not self.rejection_rule and not self.is_greedy

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # also rejects NaN; inf would divide logits into NaN
            raise InvalidRequestError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in 0..{MAX_LOGPROBS} alternatives, got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator of this request's own: seeded runs repeat exactly, whatever else is batched."""
        import torch  # only the model side samples; the coordinator never calls this

        seed = self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        return torch.Generator(device=device).manual_seed(seed)

    def noise_key(self, position: int, stream: int = 0) -> int:
        """A seeded request's key of the noise its token at ``position`` races (``tandem.sampling.seeded_race``):
        (seed, stream, position) hashed to a signed 64-bit integer, so every replica and device draws alike."""
        digest = hashlib.blake2b(f"{self.seed}:{stream}:{position}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)

    def seed_at(self, generator: torch.Generator, position: int, stream: int = 0) -> None:
        """Seeded requests draw the randomness of each position from (seed, stream, position) alone.

        A request rebuilt on another replica after a fault then goes on with the very draws it
        would have made where it was, so a seeded stream survives a move (given the same rounds).
        ``stream`` keeps the draft's draws apart from the target's. Unseeded requests keep one
        stream from ``make_generator``.
        """
        if self.seed is not None:
            digest = hashlib.blake2b(f"{self.seed}:{stream}:{position}".encode(), digest_size=8).digest()
            generator.manual_seed(int.from_bytes(digest, "little") >> 1)
