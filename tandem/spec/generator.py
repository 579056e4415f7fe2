"""The speculation loop, in one process, over a batch of requests.

Per round, for every live request: choose k (adaptive), get k proposals
from the proposer (one batched draft pass per step for all requests), run one
target forward over each request's last token plus its drafts (one batch),
decide acceptance, roll the target's KV back to the accepted prefix, and
append accepted + 1 tokens, stopping at EOS or max_new_tokens inside the run.

Invariant: a sequence's target KV holds every committed token but the last
(the last one is fed at the start of the next round). k = 0 is plain
decoding through the same path, which is what ``method none`` runs.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from tandem.engine import ForwardItem, ModelEngine
from tandem.errors import InvalidRequestError, check_token_ids
from tandem.sampling import SamplingParams, pick_tokens
from tandem.spec.adaptive import MAX_K, AcceptanceTracker, CostModel, LoadAwareCost, choose_k
from tandem.spec.proposal import Proposal, Proposer, ProposeRequest
from tandem.spec.rejection import verify


@dataclass(slots=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    k_max: int = 4  # most draft tokens per round; 0 disables speculation
    adaptive_k: bool = True  # False: always draft k_max

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise InvalidRequestError("prompt is empty: give at least one token")
        if self.max_new_tokens <= 0:
            raise InvalidRequestError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if not 0 <= self.k_max <= MAX_K:
            raise InvalidRequestError(f"k (draft tokens per round) must be in 0..{MAX_K}, got {self.k_max}")


@dataclass(slots=True)
class GenerationStats:
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # speculative rounds that ended at a rejected draft token (at most one per round)
    rounds: int = 0  # target forwards after the prefill
    spec_rounds: int = 0  # rounds that verified at least one draft token
    generated: int = 0
    elapsed_s: float = 0.0  # from the start of generation (prefill included) to the last token
    first_token_s: float = 0.0  # from the start to the first token: the target's prefill
    chosen_k: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Draft tokens accepted per speculative round."""
        return self.accepted / self.spec_rounds if self.spec_rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted: the share of draft tokens that made it into the output."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_token_acceptance(self) -> float:
        """a of Leviathan et al.: accepted / draft tokens the target judged.

        Drafts after a round's first rejection are never judged, so accepted / drafted
        understates a; each judged token is one trial, and a round has at most one failure.
        """
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "generated": self.generated,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "elapsed_s": round(self.elapsed_s, 4),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "rounds": self.rounds,
            "mean_accepted_len": round(self.mean_accepted_len, 3),
            "acceptance_rate": round(self.acceptance_rate, 4),
        }


@dataclass(slots=True)
class GenerationResult:
    token_ids: list[int]  # generated tokens only (a stop token that ended the run included)
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens)
    stats: GenerationStats


@dataclass(slots=True)
class _Live:
    """A request in flight."""

    seq_id: int
    request: GenerationRequest
    tokens: list[int]
    generator: object
    tracker: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    stats: GenerationStats = field(default_factory=GenerationStats)
    finish_reason: str | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.request.prompt_ids) :]

    def commit(self, new_tokens: list[int]) -> None:
        """Append tokens one by one, stopping at a stop token or the length limit."""
        for token in new_tokens:
            self.tokens.append(token)
            if token in self.request.stop_token_ids:
                self.finish_reason = "stop"
            elif len(self.tokens) - len(self.request.prompt_ids) >= self.request.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                return


class SpeculativeGenerator:
    """Runs requests to completion with a target engine and an optional proposer."""

    def __init__(self, target: ModelEngine, proposer: Proposer | None = None, costs: CostModel | None = None) -> None:
        self.target = target
        self.proposer = proposer
        self.costs = costs or CostModel()
        self._ids = itertools.count()
        self.max_len = target.config.max_position_embeddings

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        for r in requests:
            if len(r.prompt_ids) + r.max_new_tokens > self.max_len:
                raise InvalidRequestError(
                    f"prompt ({len(r.prompt_ids)} tokens) + max_new_tokens ({r.max_new_tokens}) "
                    f"exceeds the model's context of {self.max_len}"
                )
            check_token_ids("prompt", r.prompt_ids, self.target.config.vocab_size)
        start = time.perf_counter()
        live = [
            _Live(next(self._ids), r, list(r.prompt_ids), r.sampling.make_generator() if not r.sampling.is_greedy else None)
            for r in requests
        ]
        try:
            self._prefill(live, start)
            active = [s for s in live if not s.finish_reason]
            while active:
                self._round(active, start)
                for s in active:
                    if s.finish_reason:
                        self._release(s)
                active = [s for s in active if not s.finish_reason]
        finally:
            for s in live:
                self._release(s)
        return [GenerationResult(s.generated, s.finish_reason or "length", s.stats) for s in live]

    # ----- steps -------------------------------------------------------
    def _prefill(self, live: list[_Live], start: float) -> None:
        logits = self.target.forward([ForwardItem(s.seq_id, s.tokens, num_logits=1) for s in live])
        now = time.perf_counter()
        for s, row in zip(live, logits):
            s.commit([int(pick_tokens(row, s.request.sampling, s.generator)[0])])
            s.stats.generated, s.stats.elapsed_s = len(s.generated), now - start
            s.stats.first_token_s = now - start

    def _round_costs(self, streams: int) -> LoadAwareCost:
        """Round cost from the engines' fitted forward costs, which a prompt's prefill cannot skew.

        (Timing whole propose calls would count the draft's prefill of a long prompt as
        drafting cost and talk adaptive k out of speculating for good.)
        """
        costs = LoadAwareCost(self.costs, streams=streams)
        if self.target.cost_fit.ready:
            costs.target_base_s = self.target.cost_fit.base_s
            costs.target_per_token_s = self.target.cost_fit.per_token_s
        draft_engine = getattr(self.proposer, "engine", None)
        if draft_engine is not None and draft_engine.cost_fit.ready:
            costs.draft_base_s = draft_engine.cost_fit.base_s
            costs.draft_per_token_s = draft_engine.cost_fit.per_token_s
        elif draft_engine is None:
            costs.draft_base_s = 1e-9  # a lookup, not a model: drafting is free
        return costs

    def _choose_k(self, s: _Live, costs: LoadAwareCost) -> int:
        r = s.request
        room = min(r.max_new_tokens - len(s.generated), self.max_len - len(s.tokens)) - 1
        if self.proposer is None or room <= 0:
            return 0
        k = r.k_max if not r.adaptive_k else choose_k(s.tracker.rate, costs, r.k_max)
        return max(0, min(k, room))

    def _round(self, active: list[_Live], start: float) -> None:
        costs = self._round_costs(len(active))
        ks = [self._choose_k(s, costs) for s in active]
        proposals = [Proposal([]) for _ in active]
        drafting = [i for i, k in enumerate(ks) if k > 0]
        if drafting and self.proposer is not None:
            t0 = time.perf_counter()
            drafted = self.proposer.propose(
                [ProposeRequest(active[i].seq_id, active[i].tokens, ks[i], active[i].request.sampling, active[i].generator)
                 for i in drafting]
            )
            self.costs.observe_draft((time.perf_counter() - t0) / max(ks[i] for i in drafting))
            for i, p in zip(drafting, drafted):
                proposals[i] = p
        t0 = time.perf_counter()
        items = [
            ForwardItem(s.seq_id, [s.tokens[-1], *p.tokens], num_logits=len(p.tokens) + 1)
            for s, p in zip(active, proposals)
        ]
        logits = self.target.forward(items)
        self.costs.observe_verify(max(len(it.token_ids) for it in items), time.perf_counter() - t0)
        now = time.perf_counter()
        for s, p, k, row in zip(active, proposals, ks, logits):
            verdict = verify(row, p.tokens, p.probs, s.request.sampling, s.generator)
            committed = len(s.tokens)
            # KV now holds committed-1 + 1 + len(drafts); keep the last token and the accepted drafts.
            self.target.rollback(s.seq_id, committed + verdict.num_accepted)
            s.commit([*p.tokens[: verdict.num_accepted], verdict.next_token])
            st = s.stats
            st.rounds += 1
            st.chosen_k.append(k)
            if p.tokens:
                st.spec_rounds += 1
                st.drafted += len(p.tokens)
                st.accepted += verdict.num_accepted
                st.rejected += verdict.num_accepted < len(p.tokens)
                s.tracker.observe(len(p.tokens), verdict.num_accepted)
            st.generated, st.elapsed_s = len(s.generated), now - start

    def _release(self, s: _Live) -> None:
        if self.target.kv_cache.has_sequence(s.seq_id):
            self.target.release(s.seq_id)
        if self.proposer is not None:
            self.proposer.release(s.seq_id)
