"""The speculation loop of one request, written once for every transport.

Each round: choose k (adaptive), take a proposal (n-gram lookup, the draft
model, or the hybrid of both), send it to the verifier, commit the accepted
tokens plus the target's own, and stop at a stop token, a stop string or the
length limit. ``tandem generate`` runs it over in-process engines, the
coordinator over gRPC workers (``tandem.spec.transport``).

Pipelining: the draft is asked for one token more than is verified (its
guess of the target's extra token), and while round r is being verified the
draft already drafts round r+1 as if every draft is accepted and the guess is
right. When verification agrees, the next proposal is ready at once; when
not, it is dropped and the draft is brought back to the committed history on
its next call (its KV rolls back to the common prefix by itself). The first
proposal is drafted during the target's prefill the same way, the draft
guessing the first token.

Trees (``options.tree``): besides the chain of k, a round may send a token
tree: the draft's next-best tokens at the chain's first positions and other
n-gram continuations as branches (``tandem.spec.tree``), verified in the same
pass; the shape comes from the cost model and the request's measured
acceptance (``choose_tree``), as k does. A chain is the tree with no branches.

Heads (``medusa``, ``eagle``): the target's own heads propose. Each Prefill
and Verify asks for the next round's proposal (``propose``, a node budget
from the verification cost), and the reply carries it: a token tree rooted
after the target's next token. The loop takes it as it takes a pipelined
proposal (valid while the history is what it was drafted after), adds the
request's own n-gram continuation as a branch when the text repeats, and
verifies it: one RPC a round, no draft model. An adaptive request asks only
while asking measures faster than not (``tandem.spec.heads_payoff``); the
rounds that do not ask decode plainly, or, where ``auto`` found a draft model
beside the heads (``options.draft_between_heads``), run as ``hybrid`` rounds.

Invariant: the target's KV holds every committed token but the last, which
the next verification feeds; k = 0 is plain decoding through the same path.

Faults are not the loop's: the coordinator hands it channels that survive
their replicas (``tandem.spec.failover``). A draft channel may give up on a
call (no tokens), and say that no draft is left: the request goes on with
n-gram proposals.

Grammars (a JSON schema, tool calls that must be made): the target masks each
row to what the grammar allows, and after each Prefill and Verify says which
tokens the grammar forces next (a tool's name once its first piece is out, a
key, a closing tag): the tokens of the only text it allows there. Those become
the next round's proposal (``GRAMMAR``), whatever the method, verified whole
(k does not cut them): the target keeps them unless it spells that text with
other tokens, where a draft could miss them (a lean draft cannot even write a
special token past its vocabulary). Plain decoding (``none``) and heads
requests do not use them.

Lookup rounds (``match_rates``: the request's own text, the continuation cache,
the client's prediction, under any method): k is chosen after the lookup, from
the acceptance of the kind of match that proposes (its source and how long a
context matched, learned across the coordinator's requests), not from the
request's one rate: a long cache match is verified whole while a one-token
guess is cut or dropped where verification rows are dear. It may reach
``lookup_k_max`` (15) tokens where the draft model's k is 4: a copied run costs
rows, not draft steps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from tandem.device_key import shares_device
from tandem.errors import InternalError
from tandem.spec.adaptive import (
    EXPLORE_EVERY,
    MAX_K,
    MAX_TREE_DEPTHS,
    CostModel,
    LoadAwareCost,
    MatchRates,
    TreeShape,
    choose_k,
    choose_tree,
    expected_tokens,
    stop_below,
)
from tandem.spec.heads_payoff import HeadsPayoff, HeadsVerdicts
from tandem.spec.heads_trees import heads_budget, heads_proposal, round_tree
from tandem.spec.ngram import NgramIndex
from tandem.spec.options import SpecOptions
from tandem.spec.prediction import PredictionIndex
from tandem.spec.proposers import (
    CACHE,
    DRAFT,
    GRAMMAR,
    HEADS,
    LOOKUP_SOURCES,
    PREDICTION,
    ContinuationCache,
    DraftProposer,
    Proposal,
    ngram_proposal,
)
from tandem.spec.request import RequestState
from tandem.spec.transport import DraftChannel, Drafted, Verifier
from tandem.spec.tree import ROOT, TokenTree, children_of, kept_on_chain
from tandem.tree_rows import depths as _depths

T = TypeVar("T")

RELEASE_WAIT_S = 60.0  # longest wait for calls still in flight before a sequence is released
# The continuation cache learns a prompt's last tokens only: learning costs ~20 us a token on the
# coordinator's event loop, and a long prompt's distant tokens rarely predict its continuation.
PROMPT_TOKENS_LEARNED = 256
# A lone request whose draft has yet to read a long prompt drafts once the tokens expected to come, at
# least this many, would repay that read (``SpeculationLoop._draft_waits``): a prompt of a few hundred
# tokens is read at once, Spec-Bench's 800-token rag prompts (19-token answers) wait.
DRAFT_WAIT_FLOOR_TOKENS = 16

class RoundObserver(Protocol):
    """Where a loop reports what it does (the coordinator's Prometheus metrics)."""

    def on_round(self, k: int, drafted: int, accepted: int, source: str) -> None: ...
    def on_verify(self, seconds: float) -> None: ...
    def on_draft(self, seconds: float) -> None: ...
    def on_cache_lookup(self, seconds: float, tier: str | None) -> None: ...  # tier None: a miss


class SpeculationLoop:
    """Drives one request against one verifier and, when its method drafts, one draft channel."""

    def __init__(self, state: RequestState, seq_id: str, options: SpecOptions, verifier: Verifier,
                 draft: DraftChannel | None, costs: CostModel, max_context: int,
                 observer: RoundObserver | None = None, cache: ContinuationCache | None = None,
                 match_rates: MatchRates | None = None, heads_verdicts: HeadsVerdicts | None = None,
                 release_later: Callable[[Coroutine[Any, Any, None]], None] | None = None) -> None:
        if options.uses_draft and draft is None:
            raise ValueError(f"method {options.method!r} needs a draft channel")
        self.state = state
        self.seq_id = seq_id
        self.options = options
        self.verifier = verifier
        self.draft = (DraftProposer(draft, seq_id, state.sampling, len(state.prompt_ids))
                      if options.uses_draft and draft else None)
        self.costs = costs
        self.max_context = max_context
        self.observer = observer
        self.cache = cache if options.uses_ngram else None
        self.match_rates = match_rates  # acceptance per kind of n-gram match (see the module docstring)
        self._learned = max(0, len(state.prompt_ids) - PROMPT_TOKENS_LEARNED)  # history the cache has seen
        self._ngrams = NgramIndex()  # the history's n-grams, indexed as it grows: no rescan per round
        # The client's prediction of the answer: one more n-gram source, for every method that drafts or looks up
        self._prediction = (PredictionIndex(state.prompt_ids, state.prediction)
                            if state.prediction and (options.uses_draft or options.uses_ngram) else None)
        self._in_flight: set[asyncio.Task] = set()
        # Heads rounds ask for the next tree only while that measures faster (adaptive requests only).
        self._payoff = (HeadsPayoff.starting(heads_verdicts, options.heads_fallback)
                        if options.uses_heads and options.adaptive_k else None)
        self._rounds_at_zero = 0  # rounds adaptive k held a draft model at k = 0 (see _choose_k)
        self._draft_waiting = False  # this round goes without the draft model (see _draft_waits)
        self._model_held = False  # adaptive k held the draft model at 0 this round: it looks up instead (_round)
        # What the rounds without the draft cost (priced by the cost model) and the tokens they committed
        self._waiting_priced_s, self._waiting_tokens = 0.0, 0
        self._heads_last_round = options.uses_heads  # the round before was a heads round (or the Prefill)
        # Where the sequence's release runs once the request ends: None awaits it before ``run`` ends. A server
        # hands it to a task of its own, so that a reply's end does not wait for the workers' queues (a release
        # waits for the batch step under way there: measured up to 5 s behind a long prompt's chunk on a CPU).
        self._release_later = release_later

    # ----- the loop ------------------------------------------------------
    async def run(self) -> AsyncIterator[None]:
        """Yields after the prefill and after every round; the caller streams what was committed."""
        try:
            proposal = await self._prefill()
            yield
            while not self.state.finish_reason:
                proposal = await self._round(proposal)
                yield
        finally:
            if self._release_later is None:
                await self._release()
            else:
                self._release_later(self._release())

    async def run_to_end(self) -> RequestState:
        async for _ in self.run():
            pass
        return self.state

    async def _prefill(self) -> Proposal | None:
        s = self.state
        k = self._choose_k(after_tokens=1)
        early: asyncio.Task | None = None
        if self.draft is not None and k > 0 and self.options.pipelined and not self.options.uses_heads:
            # Draft while the target prefills: its first token is a guess of the target's first token.
            early = self._spawn(self._propose(s.prompt_ids, k + 2, verified=len(s.prompt_ids)))
        propose = self._heads_budget(first=True)  # always: a worker drafts for a sequence whose Prefill asked
        prefilled = await self.verifier.prefill(self.seq_id, s.prompt_ids, s.sampling, propose=propose)
        first = prefilled.next_token
        s.stats.prompt_tokens_reused = prefilled.reused_tokens
        if s.sampling.prompt_logprobs is not None:
            if prefilled.prompt_logprobs is None or len(prefilled.prompt_logprobs) != len(s.prompt_ids) - 1:
                raise InternalError("a target worker answered no log-probabilities for the prompt tokens the "
                                    "request asked them of")
            s.prompt_logprobs = prefilled.prompt_logprobs
        s.commit([first], prefilled.logprobs)
        self._learn()
        if propose:
            return heads_proposal(prefilled.proposal, len(s.history))
        proposal = None
        if early is not None:
            drafted = await self._timed_draft(early)
            tokens = drafted.tokens
            if len(tokens) > 1 and tokens[0] == first and not s.finish_reason:
                proposal = _pipelined(len(s.history), drafted, k + 2, skip=1)
        return self._forced(prefilled.forced) or proposal

    async def _round(self, ready: Proposal | None) -> Proposal | None:
        if self.options.uses_heads and not self._draft_instead_of_heads(ready):
            return await self._heads_round(ready)
        s, stats = self.state, self.state.stats
        started = time.perf_counter()
        self._draft_waiting = self._draft_waits()
        self._model_held = False
        stats.draft_wait_rounds += int(self._draft_waiting)
        committed = len(s.history)
        if ready is not None and ready.source == GRAMMAR and ready.base_len == committed:
            proposal, k = ready, len(ready.tokens)  # sure tokens: all verified, whatever k would be
        else:
            k = self._choose_k(after_tokens=0)
            if k == 0 and self._looks_up_instead():
                self._model_held = True
                k = self._choose_k(after_tokens=0)  # without the model: the lookup's kind of match decides
            proposal = await self._proposal(k, ready, self._choose_tree(k))
        if proposal.source in LOOKUP_SOURCES:
            k = len(proposal.tokens)  # cut to the k its kind of match earns (``_lookup_k``), up to the lookup cap
        chain = proposal.tokens[:k]
        tree = proposal.tree
        if tree is not None:  # the chain is its first branch: nodes 0..len(chain)-1
            drafts, probs, parents = tree.tokens, tree.chain_probs(), tree.parents
        else:
            drafts, probs, parents = chain, list(proposal.probs)[:k], []
        verifying = self._spawn(self.verifier.verify(self.seq_id, committed, drafts, probs, parents))
        ahead: asyncio.Task | None = None
        if (self.draft is not None and self.options.pipelined and proposal.source == DRAFT and chain
                and proposal.guess is not None and len(chain) == len(proposal.tokens)):
            # Draft round r+1 now, betting that all of round r's chain is accepted and the guess is right.
            ahead = self._spawn(self._propose([*s.history, *chain, proposal.guess], k + 1, verified=len(s.history)))
        t0 = time.perf_counter()
        verified = await verifying
        kept, next_token = verified.kept, verified.next_token
        waited = time.perf_counter() - t0
        stats.verify_wait_s += waited
        self.costs.observe_verify(len(drafts) + 1, waited)
        if self.observer:
            self.observer.on_verify(waited)
        accepted = [drafts[n] for n in kept]
        s.commit([*accepted, next_token], verified.logprobs)
        self._learn()
        along = kept_on_chain(kept, len(chain))
        self._record(k, len(drafts), len(kept), proposal, len(chain), along)
        if tree is not None:
            self._record_tree(tree, len(chain), kept, along)
        if self._draft_waiting:
            self._waiting_priced_s += self._round_costs(drafting=False).round_seconds(len(drafts))
            self._waiting_tokens += len(s.history) - committed

        next_proposal = None
        if ahead is not None:
            drafted = await self._timed_draft(ahead)
            tokens = drafted.tokens
            if accepted == chain and next_token == proposal.guess and tokens and not s.finish_reason:
                next_proposal = _pipelined(len(s.history), drafted, k + 1)
        next_proposal = self._forced(verified.forced) or next_proposal
        wall = time.perf_counter() - started
        stats.round_wall_s += wall
        if self._payoff is not None:  # a hybrid round between heads rounds: the way that does not ask
            self._payoff.observe(len(s.history) - committed, wall, catching_up=self._heads_last_round)
        self._heads_last_round = False
        return next_proposal

    def _forced(self, forced: Sequence[int]) -> Proposal | None:
        """The next round's proposal from what the grammar forces after the history (see the module docstring),
        within the room the request has left; None where there is none, or the request does not speculate."""
        s = self.state
        room = min(s.remaining, self.max_context - len(s.history)) - 1
        opts = self.options
        if not forced or s.finish_reason or room <= 0 or opts.uses_heads or not opts.forced_proposals or not (
                opts.uses_draft or opts.uses_ngram):
            return None
        return Proposal(len(s.history), list(forced[:min(room, MAX_K)]), source=GRAMMAR)

    def _draft_instead_of_heads(self, ready: Proposal | None) -> bool:
        """Whether a heads request runs this round as a ``hybrid`` one: its heads measure slower
        (``tandem.spec.heads_payoff``), a draft model is there, and no heads tree asked for in the round
        before waits to be verified (the round that stops asking verifies it)."""
        return (self.options.draft_between_heads and self.draft is not None and self._payoff is not None
                and not self._payoff.ask() and (ready is None or ready.source != HEADS))

    async def _heads_round(self, ready: Proposal | None) -> Proposal | None:
        """A round with the target's heads: verify their last proposal, get the next one in the same reply."""
        s, stats = self.state, self.state.stats
        started = time.perf_counter()
        committed = len(s.history)
        tree = self._heads_tree(ready)
        drafts = tree.tokens if tree is not None else []
        parents = tree.parents if tree is not None and not tree.is_chain else []
        asks = self._payoff is None or self._payoff.ask()
        propose = self._heads_budget() if asks else 0
        t0 = time.perf_counter()
        verified = await self.verifier.verify(self.seq_id, committed, drafts, [], parents, propose=propose)
        waited = time.perf_counter() - t0
        stats.verify_wait_s += waited
        self.costs.observe_verify(len(drafts) + 1, waited)
        if self.observer:
            self.observer.on_verify(waited)
        kept = verified.kept
        s.commit([*(drafts[n] for n in kept), verified.next_token], verified.logprobs)
        self._learn()
        stats.rounds += 1
        stats.k_counts[len(drafts)] += 1
        if self.observer:
            self.observer.on_round(len(drafts), len(drafts), len(kept), self.options.method)  # medusa / eagle
        if tree is not None:
            stats.spec_rounds += 1
            stats.drafted += len(drafts)
            stats.accepted += len(kept)
            stats.depth_offered.update(range(1, max(_depths(tree.parents)) + 2))
            stats.depth_kept.update(range(1, len(kept) + 1))
            if not tree.is_chain:
                stats.tree_rounds += 1
                stats.tree_nodes += len(tree)
        wall = time.perf_counter() - started
        stats.round_wall_s += wall
        if self._payoff is not None:
            self._payoff.observe(len(s.history) - committed, wall)
        self._heads_last_round = True
        return heads_proposal(verified.proposal, len(s.history)) if not s.finish_reason else None

    def _heads_tree(self, ready: Proposal | None) -> TokenTree | None:
        """The heads' last proposal, when it still fits the history, with the text's own repeat as a branch."""
        s, opts = self.state, self.options
        room = min(MAX_K, self.max_context - len(s.history) - 1, max(0, s.remaining - 1)) if opts.k_max else 0
        repeat, matched = ngram_proposal(s.history, min(room, opts.k_max), opts.hybrid_min_match,
                                         max(opts.hybrid_min_match, opts.ngram_max), self._ngrams)
        # Only the heads' own tree: a draft's proposal (pipelined by a hybrid round) carries the draft's
        # probabilities, which a heads tree, verified as deterministic nodes, would drop (not lossless).
        fits = ready if ready is not None and ready.source == HEADS and ready.base_len == len(s.history) else None
        return round_tree(fits, room, repeat.tokens if matched >= opts.hybrid_min_match else [])

    def _heads_budget(self, first: bool = False) -> int:
        return heads_budget(self.options, self.state, self.max_context, self.verifier.fitted_cost(), first)

    # ----- proposals -------------------------------------------------------
    async def _proposal(self, k: int, ready: Proposal | None, shape: TreeShape | None) -> Proposal:
        """This round's proposal (the policy, written once), with its token tree when ``shape`` is given.

        n-gram sources first: the request's own text, the continuation cache and the client's
        prediction, the longer match winning (on a tie the prediction, then the request's own text:
        this request's evidence). Under ``hybrid`` an n-gram match of ``hybrid_min_match``+ tokens
        beats the draft model (a long repeat is as good a guess as the draft's and costs nothing);
        otherwise the draft drafts. A lookup's proposal holds up to ``lookup_k_max`` tokens, cut to
        what its kind of match earns (``_lookup_k``), not to the draft model's k. In a tree, the
        continuations that lost become branches.
        """
        s, opts = self.state, self.options
        committed = len(s.history)
        predicted = self._predicted()
        if k == 0:  # (adaptive k holds the draft model back; a prediction's match is judged on its own)
            return predicted or Proposal(committed, [])
        branches: list[list[int]] = []  # the request's own other continuations: cut at the tree's depths
        runs: list[list[int]] = []  # the continuation cache's runs after the matched context: whole
        drafter = self._drafter
        if opts.uses_ngram or drafter is None:  # (a request whose draft is lost, or waits, goes on with n-grams)
            reach = self._lookup_cap()
            min_n = opts.ngram_min if opts.method == "ngram" or drafter is None else opts.hybrid_min_match
            max_n = max(min_n, opts.ngram_max)
            proposal, matched = ngram_proposal(s.history, reach, min_n, max_n, self._ngrams)
            if shape is not None:  # the other continuations of the request's text, of any match length
                branches = [c for c, _ in self._ngrams.lookup_continuations(s.history, k, opts.ngram_min, max_n,
                                                                             shape.width + 1)]
            if self.cache is not None:
                hit = await self._cache_lookup(reach)
                if hit is not None and hit.tokens and hit.match_len > matched:
                    proposal = Proposal(committed, list(hit.tokens[:reach]), source=CACHE, match_len=hit.match_len)
                    matched = hit.match_len
                if hit is not None and hit.tokens:
                    runs = [list(hit.tokens[:reach]), *(list(run) for run in hit.runs)]
            if predicted is not None and predicted.match_len >= matched:
                return predicted  # the client's own evidence of this answer wins a tie
            if drafter is None or (matched >= opts.hybrid_min_match and proposal.tokens):
                proposal.tokens = proposal.tokens[:self._lookup_k(proposal, k)]
                return self._with_tree(proposal, len(proposal.tokens), shape, branches, runs)
        elif predicted is not None:  # a draft model's request: the prediction matched hybrid_min_match+ tokens
            return predicted
        if ready is not None and ready.base_len == committed:
            return self._with_tree(ready, k, shape, branches, runs)
        extra = 1 if opts.pipelined else 0  # the guess of the target's extra token
        t0 = time.perf_counter()
        drafted = await self._timed_draft(self._propose(s.history, k + extra, verified=len(s.history)))
        self.costs.observe_draft((time.perf_counter() - t0) / max(1, len(drafted.tokens)))
        if extra:
            proposal = _pipelined(committed, drafted, k + 1)
        else:
            proposal = Proposal(committed, drafted.tokens, list(drafted.probs), source=DRAFT,
                                alternatives=list(drafted.alternatives))
        return self._with_tree(proposal, k, shape, branches, runs)

    def _with_tree(self, proposal: Proposal, k: int, shape: TreeShape | None,
                   branches: list[list[int]], runs: list[list[int]]) -> Proposal:
        """``proposal`` with its token tree: the chain first (sampled nodes before the deterministic ones,
        which the acceptance rule needs), then the draft's next-best tokens at the chain's first
        ``shape.depths`` positions, then the cache's runs, then the request's other continuations (cut
        at ``shape.depths``), within ``k + shape.extra_nodes`` nodes and the most a round may hold
        (``MAX_K``, and the context's room: a lookup's chain may be longer than the k the shape was
        chosen for). Unchanged when nothing but the chain would be in it.

        The cache's runs go in whole: they all followed the same (long) context, mostly share the
        chain's first tokens and part from it where earlier samples did, often past ``shape.depths``;
        the trie insert shares their common prefixes, so a run costs only its nodes after it parts."""
        chain = proposal.tokens[:k]
        if shape is None or not chain:
            return proposal
        tree = TokenTree()
        tree.add_path(chain, list(proposal.probs)[:k] or None)
        budget = min(len(chain) + shape.extra_nodes, MAX_K, self.max_context - len(self.state.history) - 1)
        for depth, alternatives in enumerate(list(proposal.alternatives)[: min(len(chain), shape.depths)]):
            for token in list(alternatives)[: shape.width]:
                tree.add_path([token], parent=depth - 1 if depth else ROOT, budget=budget)
        for run in runs:
            tree.add_path(run[:k], budget=budget)
        for branch in branches:
            tree.add_path(branch[: shape.depths], budget=budget)
        if len(tree) == len(chain):
            return proposal
        proposal.tree = tree
        return proposal

    def _predicted(self) -> Proposal | None:
        """The prediction's continuation of the history (``tandem.spec.prediction``), cut to what its kind of
        match earns (``_lookup_k``); None where it matches nothing, the request has none, or its room is gone.
        Matches shorter than ``hybrid_min_match`` are not taken where a draft model drafts instead, as the
        request's own text's are not."""
        reach = self._lookup_cap()
        if self._prediction is None or reach <= 0:
            return None
        opts = self.options
        min_n = opts.ngram_min if self._drafter is None else opts.hybrid_min_match
        tokens, matched = self._prediction.lookup(self.state.history, reach, min_n, max(min_n, opts.ngram_max))
        proposal = Proposal(len(self.state.history), tokens, source=PREDICTION, match_len=matched)
        proposal.tokens = tokens[:self._lookup_k(proposal, reach)]
        return proposal if proposal.tokens else None

    def _lookup_cap(self) -> int:
        """The most tokens a lookup may propose this round: ``lookup_k_max`` (a fixed k: the request's k), within
        the request's room."""
        s, opts = self.state, self.options
        room = min(s.remaining, self.max_context - len(s.history)) - 1
        return max(0, min(opts.lookup_k_max if opts.adaptive_k else opts.k_max, room))

    def _lookup_k(self, proposal: Proposal, k: int) -> int:
        """How many of a lookup's proposed tokens to verify: as many as its kind of match (source, matched
        length, greedy or sampled) earns at the round costs, learned over every request (``MatchRates``), for an
        adaptive request; else ``k``."""
        if self.match_rates is None or not self.options.adaptive_k or not proposal.tokens:
            return min(k, len(proposal.tokens))
        return self.match_rates.choose_k(proposal.source, proposal.match_len, not self.state.sampling.is_greedy,
                                         self._round_costs(drafting=False), len(proposal.tokens))

    async def _cache_lookup(self, k: int) -> Any:
        assert self.cache is not None
        t0 = time.perf_counter()
        hit = await self.cache.lookup(self.state.history, k)
        if self.observer:
            self.observer.on_cache_lookup(time.perf_counter() - t0, hit.source if hit is not None else None)
        return hit

    def _learn(self, final: bool = False) -> None:
        """Teach the continuation cache what this request committed since the last call."""
        if self.cache is None:
            return
        history = self.state.history
        self.cache.learn(history, self._learned, final=final)
        self._learned = len(history)

    async def _timed_draft(self, call: Awaitable[T]) -> T:
        t0 = time.perf_counter()
        try:
            return await call
        finally:
            waited = time.perf_counter() - t0
            self.state.stats.draft_wait_s += waited
            if self.observer:
                self.observer.on_draft(waited)

    async def _propose(self, tokens: list[int], k: int, verified: int) -> Drafted:
        """The draft's proposal after ``tokens``; none without a draft. With none left, the request goes on
        with n-gram proposals. ``verified``: how many of ``tokens`` are committed (the rest are guesses of a
        pipelined round), counted where ``tokens`` were taken, since the history grows while this waits."""
        if self.draft is None:
            return Drafted([])
        drafted = await self.draft.propose(tokens, k, self.options.tree_width if self.options.tree != "off" else 0,
                                           verified, self._stop_below(k))
        if drafted.gone:
            self.draft = None
        return drafted

    # ----- adaptive k ------------------------------------------------------
    @property
    def _draft_stops(self) -> bool:
        """Whether this round's draft model stops where it is unsure: an adaptive request's (a fixed k is drafted
        whole), when the round drafts with the model."""
        return self.options.adaptive_k and self.options.draft_stops and self._drafter is not None

    def _stop_below(self, k: int) -> float:
        """Where this request's draft model stops drafting (``adaptive.stop_below``; 0: it drafts all ``k``), at its
        acceptance and the round costs."""
        if not self._draft_stops:
            return 0.0
        return stop_below(self.state.tracker.rate, self._round_costs(drafting=True), k)

    def _by_evidence(self) -> bool:
        """Whether this round's k is chosen after the lookup, by the kind of match (n-gram rounds alone)."""
        return self.match_rates is not None and self._drafter is None and self.options.adaptive_k

    def _choose_k(self, after_tokens: int) -> int:
        s, opts = self.state, self.options
        room = min(s.remaining - after_tokens, self.max_context - len(s.history) - after_tokens) - 1
        if not (opts.uses_draft or opts.uses_ngram) or room <= 0:
            return 0
        if not opts.adaptive_k or self._by_evidence():  # (by evidence: the lookup's kind cuts it)
            return min(opts.k_max, room)
        costs = self._round_costs()
        k = choose_k(s.tracker.rate, costs, opts.k_max)
        if k > 0 and self._draft_stops:
            # The draft model stops where it is unsure (``_stop_below``), so how far to draft is its call, round
            # by round, and k, chosen for the request's mean rate, is only a cap: it drafts up to the request's
            # own. (Replayed on the target's answers, stopping within the best fixed k gained 3%, within 4
            # tokens 7%: a sure run goes on where the mean rate would have cut it.)
            k = opts.k_max
        if k == 0 and self._drafter is not None:
            # Explore: the request's acceptance and the draft worker's cost fit are measured only when
            # the draft drafts, so a rate or a fit that turned against drafting (a noisy warm-up, an
            # early patch of text the draft cannot guess) would hold k at 0 for good (measured: a whole
            # distributed_bench run at mean k 0.00). Every EXPLORE_EVERY-th round at 0 drafts one token:
            # one draft step and one verified row in that many plain steps.
            self._rounds_at_zero += 1
            if self._rounds_at_zero % EXPLORE_EVERY == 0:
                k = 1
        if k > 0 and not self._catch_up_pays(k, costs):
            return 0
        return min(k, room)

    def _choose_tree(self, k: int) -> TreeShape | None:
        """This round's tree shape (None: a chain): see ``choose_tree``; ``on`` takes the largest that fits."""
        opts = self.options
        if opts.tree == "off" or k <= 0:
            return None
        room = self.max_context - len(self.state.history) - 1  # the tree's rows occupy KV during verification
        max_nodes = min(MAX_K, room)
        if opts.tree == "on":
            for depths in range(min(k, MAX_TREE_DEPTHS), 0, -1):
                if k + depths * opts.tree_width <= max_nodes:
                    return TreeShape(depths, opts.tree_width)
            return None
        tracker = self.state.tracker
        return choose_tree(tracker.rate, tracker.branch_rate, self._round_costs(), k, opts.tree_width, max_nodes)

    def _round_costs(self, drafting: bool | None = None) -> LoadAwareCost:
        """What a round costs at the current load, from the workers' fitted forward costs; with the draft
        model's steps when ``drafting`` (default: whether this round drafts with it).

        (Timing whole propose calls would count the draft's prefill of a long prompt as
        drafting cost and talk adaptive k out of speculating for good.)
        """
        costs = LoadAwareCost(self.costs, streams=self.verifier.streams)
        target_fit = self.verifier.fitted_cost()
        if target_fit is not None:
            costs.target_base_s, costs.target_per_token_s = target_fit.base_s, target_fit.per_token_s
        if drafting is None:
            drafting = self._drafter is not None
        if not drafting or self.draft is None:
            costs.draft_base_s = 1e-9  # a lookup, not a model: drafting is free
        elif (draft_fit := self.draft.channel.fitted_cost()) is not None:
            # hybrid plans with the draft model's cost: the expensive case
            costs.draft_base_s, costs.draft_per_token_s = draft_fit.base_s, draft_fit.per_token_s
            costs.draft_calls_per_batch = draft_fit.calls_per_batch
            costs.draft_shares_device = (target_fit is not None
                                         and shares_device(target_fit.device_key, draft_fit.device_key))
        return costs

    def _catch_up_pays(self, k: int, costs: LoadAwareCost) -> bool:
        """Whether drafting now repays feeding the draft what it has not seen of this sequence.

        A draft that has been left out (a new prompt, or rounds at k = 0) must first read the
        missing tokens, less what its prefix cache holds (``DraftProposer.unread``): one long draft
        forward. Under load that forward holds up every stream sharing the machine, so it is charged
        once per stream; it pays only if the time the remaining tokens save at this k exceeds it.
        Without this, streams that load had pushed to k = 0 restart drafting near their end, when the
        catch-up cannot pay back.

        A lone stream always may: its catch-up delays nobody else, and the estimate (the
        draft's per-token cost, fitted on decode-sized batches where int8 works row by row)
        overstates a catch-up, which runs through the dense weights; applied alone, it kept
        single streams at k = 0 after a bad patch (measured: mean k 1.3 instead of 2.8).
        """
        if self._drafter is None or costs.streams <= 1:
            return True  # (a lone stream: _draft_waits weighs its catch-up)
        behind = self.draft.unread(self.state.history)
        if behind <= MAX_K + 1:
            return True  # a draft that took part in the last round: what it lacks rides on the next Propose
        per_token_s = costs.draft_per_token_s or costs.fallback.draft_step_s
        catch_up_s = behind * per_token_s * max(1, costs.streams)
        plain_s_per_token = costs.round_seconds(0)
        spec_s_per_token = costs.round_seconds(k) / expected_tokens(self.state.tracker.rate, k)
        return self.state.remaining * (plain_s_per_token - spec_s_per_token) > catch_up_s

    @property
    def _drafter(self) -> DraftProposer | None:
        """The draft model this round drafts with: none when the request has none, while it waits, or while
        adaptive k holds it back and the round looks up instead."""
        return None if self._draft_waiting or self._model_held else self.draft

    def _looks_up_instead(self) -> bool:
        """Whether a round whose draft model adaptive k held at 0 runs as an n-gram round instead of a plain step.

        Adaptive k holds the draft model back where its steps cost more than its tokens save: under load, where
        plain batching already spends the compute a lone stream leaves idle, and each stream's draft steps and
        rows are paid for every stream. A lookup costs no model step, so a ``hybrid`` request (``auto``'s
        choice with a draft model) still proposes what its text, the continuation cache or the client's
        prediction repeat, verified as far as the kind of match earns (``_lookup_k``), as an ``ngram`` request
        does. Before, such a round was a plain step. Measured with the Qwen pair through real processes on an AMX
        Xeon (``benchmarks/load_curve.py``): with four clients at once ``ngram`` gave 1.30-1.33x target-only and
        ``auto``, its rounds mostly held at 0, 0.89x; with this, ``auto`` 1.17x (eight clients: 1.04x -> 1.26x),
        a lone stream unchanged (1.63x)."""
        opts = self.options
        return self._drafter is not None and opts.uses_ngram and opts.adaptive_k

    def _draft_waits(self) -> bool:
        """Whether this round goes without the draft model: reading what it lacks would not pay yet.

        A draft that has not read the prompt (or fell far behind) must first read it: one long draft
        forward, a prefill. Where it is hidden behind the target's own prefill (pipelined, on hardware
        of its own) or shared by other streams (``_catch_up_pays``), that is accounted elsewhere; a lone
        unpipelined stream pays it in full, before its first drafted token. For an 800-token prompt on
        a 2-core CPU that is a second or more, and a short answer never repays it (Spec-Bench's rag,
        19-token answers: 0.9x target-only with the draft, 1.15x with n-grams alone; measured).

        The answer's length is unknown, so this is a ski rental: the request runs n-gram rounds (a
        ``draft`` request: its own text's repeats) until the tokens still expected, taken as
        the ones generated so far (at least ``DRAFT_WAIT_FLOOR_TOKENS``, at most what is left), times
        what drafting saves per token exceed the catch-up at the draft worker's measured price of a prompt
        token (``PromptTokenCost``, first priced by the warm-up). Drafting saves against what the waiting
        rounds have cost per token: a plain step's price at first, less where their lookups commit runs of
        the prompt's text (the cost model at the request's rate, which waiting rounds do not move:
        ``_record``). Counted against plain steps, the tokens of one lookup round that copied the prompt's
        text made the draft read an 805-token rag prompt after that round, and the 19-token answer took
        19 s to decode where waiting took 7 (Spec-Bench rag, fp32 on a Zen 1). A long answer loses at most about
        the catch-up's price; a short one never pays it. A prompt of a few hundred tokens is read at
        once. The tokens to read are those the draft lacks less the prompt blocks the draft's own prefix
        cache holds (``DraftProposer.unread``): one long system prompt before every question is read once,
        not priced whole per request (``benchmarks/shared_prompt.py``, 7 questions after a cached
        650-token system prompt: 1.11x target-only priced whole, 1.35x now). The target's cache says
        nothing here: the draft caches a prompt only once it drafted after it, and a request that waited
        to the end did not.
        """
        draft, opts, s = self.draft, self.options, self.state
        if (draft is None or not opts.draft_waits or opts.pipelined or not opts.adaptive_k
                or self.verifier.streams > 1):
            return False
        behind = draft.unread(s.history)
        fit = draft.channel.fitted_cost()
        if behind <= MAX_K + 1 or fit is None or fit.prompt_token_s <= 0:
            return False
        costs = self._round_costs(drafting=True)
        rate = s.tracker.rate
        k = choose_k(rate, costs, opts.k_max)
        if k == 0:
            return False  # drafting does not pay at all: adaptive k holds the draft at 0 (and explores)
        without_draft = costs.round_seconds(0)  # a plain step per token
        if self._waiting_tokens:
            without_draft = min(without_draft, self._waiting_priced_s / self._waiting_tokens)
        saved_per_token = without_draft - costs.round_seconds(k) / expected_tokens(rate, k)
        to_come = min(s.remaining, max(s.num_generated, DRAFT_WAIT_FLOOR_TOKENS))
        return to_come * saved_per_token < behind * fit.prompt_token_s

    # ----- bookkeeping -----------------------------------------------------
    def _record(self, k: int, drafted: int, accepted: int, proposal: Proposal, chain_len: int, along: int) -> None:
        """A round's statistics; ``along``: the accepted tokens on the chain (a tree's first branch), which
        the acceptance rate that k plans with counts (a chain: all of them)."""
        stats, source = self.state.stats, proposal.source
        stats.rounds += 1
        stats.k_counts[k] += 1
        if drafted:
            stats.spec_rounds += 1
            stats.drafted += drafted
            stats.accepted += accepted
            stats.rejected += along < chain_len
            stats.ngram_rounds += source in LOOKUP_SOURCES
            stats.cache_rounds += source == CACHE
            stats.forced_tokens += accepted if source == GRAMMAR else 0
            if source == PREDICTION:
                stats.prediction_accepted += accepted
                stats.prediction_rejected += drafted - accepted
            # (a waiting or held round's n-gram guesses say nothing of the draft's, nor sure tokens of anyone's)
            if not (self._draft_waiting or self._model_held) and source != GRAMMAR:
                self.state.tracker.observe(chain_len, along)
            if self.match_rates is not None and self.options.adaptive_k and source in LOOKUP_SOURCES:
                self.match_rates.observe(source, proposal.match_len, not self.state.sampling.is_greedy,
                                         chain_len, along)
        if self.observer:
            self.observer.on_round(k, drafted, accepted, source)

    def _record_tree(self, tree: TokenTree, chain_len: int, kept: list[int], along: int) -> None:
        """What a tree round teaches: did a candidate off the chain save the round where the chain failed?"""
        stats = self.state.stats
        stats.tree_rounds += 1
        stats.tree_nodes += len(tree)
        stats.branch_tokens += len(kept) - along
        if along == chain_len:
            return
        parent = along - 1 if along else ROOT
        others = [c for c in children_of(tree.parents).get(parent, []) if c != along]
        if not others:
            return
        if len(kept) > along:
            self.state.tracker.observe_branches(others.index(kept[along]) + 1, kept=True)
        else:
            self.state.tracker.observe_branches(len(others), kept=False)

    def _spawn(self, call: Awaitable[Any]) -> asyncio.Task:
        task = asyncio.ensure_future(call)
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)
        return task

    async def _release(self) -> None:
        """Free the KV on both sides, after any call still in flight (it could re-create the sequence)."""
        if self.state.finish_reason:
            self._learn(final=True)  # the last tokens' continuations are known only now
        pending = list(self._in_flight)
        if pending:
            done, _ = await asyncio.wait(pending, timeout=RELEASE_WAIT_S)
            for task in done:  # retrieved, so that an abandoned call's error is not reported as lost
                if not task.cancelled():
                    task.exception()
        releases = [self.verifier.release(self.seq_id)]
        if self.draft is not None:
            releases.append(self.draft.release())
        await asyncio.shield(asyncio.gather(*releases, return_exceptions=True))


def _pipelined(base_len: int, drafted: Drafted, asked: int, skip: int = 0) -> Proposal:
    """A pipelined draft's proposal after ``base_len`` tokens: what it drafted after ``skip`` tokens (the Prefill's
    guess of the first token), its last token the guess of the target's extra one when it drafted all ``asked``;
    a draft that stopped where it was unsure guessed none, and all it drafted is chain."""
    tokens, probs, alternatives = drafted.tokens, list(drafted.probs), list(drafted.alternatives)
    end = len(tokens) - 1 if len(tokens) == asked else len(tokens)
    guess = tokens[-1] if end < len(tokens) else None
    return Proposal(base_len, tokens[skip:end], probs[skip:end], guess, DRAFT, alternatives[skip:end])
