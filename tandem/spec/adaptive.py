"""Adaptive k: per request, draft as many tokens as maximise expected tokens per second.

With per-token acceptance rate a, drafting k tokens yields on average
E(k) = (1 - a^(k+1)) / (1 - a) tokens per round (Leviathan et al. 2023), and
a round costs k draft steps plus one verification of k+1 tokens. The cost
model learns both from measured times (exponential moving averages);
the acceptance rate is learned per request. k = 0 (plain decoding) wins
when the draft is too slow or too often wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.cost_fit import ForwardCostFit

# A larger k must promise this much more throughput than a smaller one: ties go to the smaller k,
# which wastes less work under load.
TIE_MARGIN = 1.02

# Most draft tokens per round: k + 1 verified tokens stay within the attention backend's
# row-by-row (batch-invariant) range, and deeper drafts pay off only at acceptance rates
# no real pair reaches.
MAX_K = 15
# Tokens a round may hold beyond a sequence's history (a verified k-chain and the target's own token): the room a
# KV pool keeps for them (tandem/kv_admission.py, the coordinator's sequence_room).
IN_FLIGHT_TOKENS = MAX_K + 1


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
    # Verification seconds against the rows verified, as this loop waited for them (1 to MAX_K + 1
    # rows): what one more row really costs. The workers' fit also sees prompt prefills, whose
    # per-token cost is far below a small batch's per-row cost where compute binds (fp32 on a CPU
    # without bf16: a prefill token ~30 ms, a verify row ~100 ms), so trees are charged this one.
    verify_rows: ForwardCostFit = field(default_factory=lambda: ForwardCostFit(min_spread=1.0, max_tokens=2 * MAX_K))

    def observe_draft(self, seconds_per_step: float) -> None:
        self.draft_step_s = self._mix(self.draft_step_s, seconds_per_step, self.draft_measured)
        self.draft_measured = True

    def observe_verify(self, num_tokens: int, seconds: float) -> None:
        self.verify_rows.observe(num_tokens, seconds)
        base = seconds / (1 + self.verify_slope * (num_tokens - 1))
        self.verify_base_s = self._mix(self.verify_base_s, base, self.verify_measured)
        self.verify_measured = True

    def round_seconds(self, k: int, extra_nodes: int = 0) -> float:
        """k draft steps and a verification of k + 1 tokens (plus a tree's ``extra_nodes``)."""
        return k * self.draft_step_s + self.verify_base_s * (1 + self.verify_slope * (k + extra_nodes))

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
    # Trees: where the chain was rejected and the tree had other candidates, how often each candidate
    # tried (in order) was the one kept (prior: 1 of 4).
    branch_hits: float = 1.0
    branch_misses: float = 3.0

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.accepted += num_accepted
        # A round ends at its first rejection: at most one rejection event per round.
        self.rejected += 1 if num_accepted < num_drafted else 0

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe_branches(self, tried: int, kept: bool) -> None:
        """After a chain's rejection: ``tried`` other candidates were tried in order, the last kept or not."""
        self.branch_hits += kept
        self.branch_misses += tried - kept

    @property
    def branch_rate(self) -> float:
        """Chance that one more candidate at a rejected position is the one kept."""
        return self.branch_hits / (self.branch_hits + self.branch_misses)


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
    # A draft worker on the target's own device (``tandem.device_key``), and how many calls its batch steps hold
    # (the worker's measure; 0: not known). See ``draft_step_s``.
    draft_shares_device: bool = False
    draft_calls_per_batch: float = 0.0

    @property
    def speculation_margin(self) -> float:
        return TIE_MARGIN + self.margin_per_extra_stream * (max(1, self.streams) - 1)

    def round_seconds(self, k: int, extra_nodes: int = 0) -> float:
        n = max(1, self.streams)
        if self.target_base_s > 0:
            verify = self.target_base_s + self.target_per_token_s * n * (k + 1)
        else:
            verify = self.fallback.verify_base_s * (1 + self.fallback.verify_slope * k)
        if extra_nodes:  # a tree's rows, at the dearer of the two per-row measures (see CostModel.verify_rows)
            row_s = max(self.target_per_token_s * n, self.fallback.verify_rows.per_token_s,
                        self.fallback.verify_base_s * self.fallback.verify_slope)
            verify += row_s * extra_nodes
        return k * self.draft_step_s() + verify

    def draft_step_s(self) -> float:
        """What one draft step of this stream costs its round, the other streams' steps included.

        The round above has every stream draft in one batch. Where the draft worker has a device of its own that
        holds: a step of a batch of ``streams``. Where it shares the target's device, every draft batch is time
        the device does not verify, and streams out of step draft in batches of their own: each round of the
        ``streams`` streams then takes ``streams / m`` draft batches of ``m`` calls (``m``: the calls its steps
        held, as the draft worker measures them). Measured with the Qwen pair on one 2-core AMX Xeon, two
        clients: the draft's steps held 1.08 calls, a draft call took 0.30 s where a target step took 0.22 s, and
        `auto` ran at 0.84-0.91x `ngram`, where the full-batch price had the draft model pay."""
        if self.draft_base_s <= 0:
            return self.fallback.draft_step_s
        n = max(1, self.streams)
        if not self.draft_shares_device or n == 1:
            return self.draft_base_s + self.draft_per_token_s * n
        m = min(float(n), max(1.0, self.draft_calls_per_batch))
        return (self.draft_base_s + self.draft_per_token_s * m) * n / m


class RoundCost(Protocol):
    def round_seconds(self, k: int, extra_nodes: int = 0) -> float: ...

    @property
    def speculation_margin(self) -> float: ...  # how much better than k = 0 drafting must look


# The highest stop_below asked: a cost fit gone wrong must not stop every draft after its first token.
MAX_STOP_BELOW = 0.9


def stop_below(acceptance: float, costs: RoundCost, k: int) -> float:
    """Where a draft of ``k`` tokens should stop (``ProposeRequest.stop_below``): below this product of its
    top probabilities so far, one more drafted token is expected to cost more time than it saves.

    The draft's top probability at a position tracks how often the target agrees there (Qwen2.5-Coder
    0.5B against 1.5B on Spec-Bench: 24% of tokens drawn at under 0.3 kept, 99% at over 0.95), so the product
    ``P`` of those drafted so far estimates that all of them are kept, and the next one is kept with about
    ``P * acceptance``. One more token costs a draft step and a verified row (``round_seconds(k) -
    round_seconds(k - 1)``); spent on plain progress at this k's pace (``expected_tokens / round_seconds``)
    that time would bring ``cost * pace`` tokens. So drafting goes on while ``P * acceptance`` exceeds that.
    Replayed on the target's own answers (21 HumanEval and Spec-Bench prompts, 96 tokens, a draft step 0.22 of
    the target's), this is about 0.5, and stopping there within 4 tokens brings 1.74 tokens per target step's
    time where the best fixed k (3) brings 1.63 (benchmarks/README.md has spec_bench's figures)."""
    if k <= 1 or acceptance <= 0.0:
        return 0.0
    full = costs.round_seconds(k)
    step_s = full - costs.round_seconds(k - 1)
    pace = expected_tokens(acceptance, k) / full
    return min(MAX_STOP_BELOW, max(0.0, step_s * pace / acceptance))


def choose_k(acceptance: float, costs: RoundCost, k_max: int) -> int:
    """The k in 0..k_max with the most expected tokens per second (see the margins above)."""
    best_k, best_rate = 0, 1.0 / costs.round_seconds(0)
    for k in range(1, k_max + 1):
        rate = expected_tokens(acceptance, k) / costs.round_seconds(k)
        if rate > best_rate * (costs.speculation_margin if best_k == 0 else TIE_MARGIN):
            best_k, best_rate = k, rate
    return best_k


# Evidence kinds of an n-gram proposal: where it came from and how long a context matched, in bands
# whose acceptance differs (measured on Qwen 1.5B rollouts at T = 0.8, benchmarks/cache_replay.py:
# a one-token match of the request's text kept 0.44 of 4 proposed tokens, a 2-token one 1.05, a
# cache match of 8 tokens 2.7-3.8).
MATCH_BANDS = (1, 2, 4, 7)  # upper bounds of the bands; longer matches share the last band
MATCH_MEMORY = 200.0  # observations a kind's rate remembers (older ones fade): workloads change
# A kind that earns k = 0 is still verified at k = 1 every this many times it proposes, so that its
# rate can recover when the workload changes (the price: one row in that many plain steps).
EXPLORE_EVERY = 16


def match_band(match_len: int) -> int:
    """The band of a match length: the first of MATCH_BANDS that holds it, else one past the last."""
    for bound in MATCH_BANDS:
        if match_len <= bound:
            return bound
    return MATCH_BANDS[-1] + 1


@dataclass(slots=True)
class MatchRates:
    """Acceptance per kind of n-gram evidence, learned from every request of one coordinator.

    A request's own tracker mixes its long cache matches with its one-token guesses, so one rate
    either wastes verification rows on the guesses or gives up the matches. Keyed by (source,
    match band, sampled): a kind's rate decides how many of its tokens a round verifies (``choose_k``
    after the lookup). Shared across requests because a request meets each kind only a few times;
    one event loop uses it (no lock). Each kind forgets beyond ``MATCH_MEMORY`` observations.
    """

    trackers: dict[tuple[str, int, bool], AcceptanceTracker] = field(default_factory=dict)
    dropped: dict[tuple[str, int, bool], int] = field(default_factory=dict)  # proposals cut to k = 0, per kind

    def rate(self, source: str, match_len: int, sampled: bool) -> float:
        tracker = self.trackers.get((source, match_band(match_len), sampled))
        return tracker.rate if tracker is not None else AcceptanceTracker().rate

    def choose_k(self, source: str, match_len: int, sampled: bool, costs: RoundCost, k_max: int) -> int:
        """How many of a proposal's ``k_max`` tokens to verify (``choose_k`` at the kind's rate; see EXPLORE_EVERY)."""
        k = choose_k(self.rate(source, match_len, sampled), costs, k_max)
        if k == 0 and k_max > 0:
            key = (source, match_band(match_len), sampled)
            self.dropped[key] = self.dropped.get(key, 0) + 1
            if self.dropped[key] % EXPLORE_EVERY == 0:
                return 1
        return k

    def snapshot(self) -> list[dict[str, Any]]:
        """Each kind seen so far: its rate and the proposals it dropped (the coordinator's metrics)."""
        return [{"source": source, "band": band, "sampled": sampled, "rate": self.rate(source, band, sampled),
                 "dropped": self.dropped.get((source, band, sampled), 0)}
                for source, band, sampled in sorted(set(self.trackers) | set(self.dropped))]

    def observe(self, source: str, match_len: int, sampled: bool, num_drafted: int, num_accepted: int) -> None:
        tracker = self.trackers.setdefault((source, match_band(match_len), sampled), AcceptanceTracker())
        tracker.observe(num_drafted, num_accepted)
        seen = tracker.accepted + tracker.rejected
        if seen > MATCH_MEMORY:
            fade = MATCH_MEMORY / seen
            tracker.accepted *= fade
            tracker.rejected *= fade


# Speculation trees: candidates beyond the chain go at its first positions, where a round is most
# often decided (the chain reaches depth d with probability a^(d-1)).
MAX_TREE_DEPTHS = 3


@dataclass(slots=True, frozen=True)
class TreeShape:
    """Besides the chain of k: ``width`` other candidates at each of its first ``depths`` positions."""

    depths: int
    width: int

    @property
    def extra_nodes(self) -> int:
        return self.depths * self.width


def expected_tree_tokens(acceptance: float, branch_rate: float, k: int, shape: TreeShape) -> float:
    """Mean tokens per round of a chain of k with ``shape``'s extra candidates.

    The chain is rejected at depth d with probability a^(d-1) (1 - a); then one of the ``width``
    other candidates there is kept with probability 1 - (1 - b)^width (b: ``branch_rate``,
    measured per request): one more token than the chain gave (deeper branches, such as an
    n-gram continuation's, are not counted).
    """
    rejected_early = sum(acceptance ** (d - 1) * (1 - acceptance) for d in range(1, min(k, shape.depths) + 1))
    return expected_tokens(acceptance, k) + (1 - (1 - branch_rate) ** shape.width) * rejected_early


def choose_tree(acceptance: float, branch_rate: float, costs: RoundCost, k: int, max_width: int,
                max_nodes: int) -> TreeShape | None:
    """The tree shape with the most expected tokens per second at this k, or None when the chain wins.

    A tree must beat the chain by ``TIE_MARGIN``, and a larger tree the smaller: extra rows make
    every verification longer.
    """
    best, best_rate = None, expected_tokens(acceptance, k) / costs.round_seconds(k)
    for width in range(1, max_width + 1):
        for depths in range(1, min(k, MAX_TREE_DEPTHS) + 1):
            shape = TreeShape(depths, width)
            if k + shape.extra_nodes > max_nodes:
                break
            tokens = expected_tree_tokens(acceptance, branch_rate, k, shape)
            rate = tokens / costs.round_seconds(k, shape.extra_nodes)
            if rate > best_rate * TIE_MARGIN:
                best, best_rate = shape, rate
    return best
