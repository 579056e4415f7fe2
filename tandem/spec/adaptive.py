"""Adaptive k: per request, draft as many tokens as maximise expected tokens per second.

With per-token acceptance rate a, drafting k tokens yields on average
E(k) = (1 - a^(k+1)) / (1 - a) tokens per round (Leviathan et al. 2023), and
a round costs k draft steps plus one verification of k+1 tokens. The cost
model learns both from measured times (exponential moving averages);
the acceptance rate is learned per request. k = 0 (plain decoding) wins
when the draft is too slow or too often wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# A larger k must promise this much more throughput than a smaller one: ties go to the smaller k,
# which wastes less work under load.
TIE_MARGIN = 1.02

# Most draft tokens per round: k + 1 verified tokens stay within the attention backend's
# row-by-row (batch-invariant) range, and deeper drafts pay off only at acceptance rates
# no real pair reaches.
MAX_K = 15


def expected_tokens(acceptance: float, k: int) -> float:
    """Mean tokens per round (accepted drafts + the target's own token) with i.i.d. acceptance."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclass(slots=True)
class CostModel:
    """Measured seconds of a draft step and of a verification, shared by the requests of one pairing.

    A verification of n tokens is modelled as ``verify_base_s * (1 + verify_slope * (n - 1))``:
    on a memory-bound target, 5 tokens cost about 1.07x one (MODELS.md), hence the small
    slope. The priors only order the first round (a draft step about a third of a target
    step); the first measurement of each replaces them, later ones are averaged in.
    """

    draft_step_s: float = 0.3
    verify_base_s: float = 1.0
    verify_slope: float = 0.02
    smoothing: float = 0.2
    draft_measured: bool = False
    verify_measured: bool = False

    def observe_draft(self, seconds_per_step: float) -> None:
        self.draft_step_s = self._mix(self.draft_step_s, seconds_per_step, self.draft_measured)
        self.draft_measured = True

    def observe_verify(self, num_tokens: int, seconds: float) -> None:
        base = seconds / (1 + self.verify_slope * (num_tokens - 1))
        self.verify_base_s = self._mix(self.verify_base_s, base, self.verify_measured)
        self.verify_measured = True

    def round_seconds(self, k: int) -> float:
        return k * self.draft_step_s + self.verify_base_s * (1 + self.verify_slope * k)

    @property
    def speculation_margin(self) -> float:
        return TIE_MARGIN

    def _mix(self, old: float, new: float, measured: bool) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new if measured else new


@dataclass(slots=True)
class AcceptanceTracker:
    """A request's per-token acceptance rate, from a Beta-like prior plus what it has seen."""

    accepted: float = 3.0  # prior: 3 of 4 accepted, so a fresh request tries speculation
    rejected: float = 1.0

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.accepted += num_accepted
        # A round ends at its first rejection: at most one rejection event per round.
        self.rejected += 1 if num_accepted < num_drafted else 0

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


@dataclass(slots=True)
class LoadAwareCost:
    """Round cost of one stream when ``streams`` similar streams share the same workers.

    Every stream drafting k tokens makes each verification carry
    ``streams * (k + 1)`` tokens and each draft step ``streams`` tokens, so
    the round costs ``k * draft(streams) + verify(streams * (k + 1))``.
    Falls back to the request-level ``CostModel`` measurements for a worker
    that has not reported a fit yet.
    """

    fallback: CostModel
    streams: int = 1
    target_base_s: float = 0.0
    target_per_token_s: float = 0.0
    draft_base_s: float = 0.0
    draft_per_token_s: float = 0.0
    # The cost above assumes every stream's calls share full batches. Measured with 8 streams on
    # one shared CPU, batches held 4-5 of them and speculation ran at 0.7-0.9x target-only where
    # this model promised 1.1x; so under load, drafting must promise a clearer gain over k = 0.
    margin_per_extra_stream: float = 0.05

    @property
    def speculation_margin(self) -> float:
        return TIE_MARGIN + self.margin_per_extra_stream * (max(1, self.streams) - 1)

    def round_seconds(self, k: int) -> float:
        n = max(1, self.streams)
        if self.target_base_s > 0:
            verify = self.target_base_s + self.target_per_token_s * n * (k + 1)
        else:
            verify = self.fallback.verify_base_s * (1 + self.fallback.verify_slope * k)
        draft_step = (self.draft_base_s + self.draft_per_token_s * n if self.draft_base_s > 0
                      else self.fallback.draft_step_s)
        return k * draft_step + verify


class RoundCost(Protocol):
    def round_seconds(self, k: int) -> float: ...

    @property
    def speculation_margin(self) -> float: ...  # how much better than k = 0 drafting must look


def choose_k(acceptance: float, costs: RoundCost, k_max: int) -> int:
    """The k in 0..k_max with the most expected tokens per second (see the margins above)."""
    best_k, best_rate = 0, 1.0 / costs.round_seconds(0)
    for k in range(1, k_max + 1):
        rate = expected_tokens(acceptance, k) / costs.round_seconds(k)
        if rate > best_rate * (costs.speculation_margin if best_k == 0 else TIE_MARGIN):
            best_k, best_rate = k, rate
    return best_k
