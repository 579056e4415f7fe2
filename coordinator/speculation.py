"""The distributed speculation loop of one request, with pipelined drafting.

Each round: take a proposal (drafts valid for the current history), send it
to the target's Verify, commit accepted + 1 tokens. Pipelining: the draft is
asked for one token more than is verified (its guess of the target's extra
token), and while round r is being verified the draft already drafts round
r+1 as if every draft is accepted and the guess is right. When verification
agrees the next proposal is ready at once; when not, it is dropped and the
draft is brought back to the committed history (its KV rolls back to the
common prefix by itself). The very first proposal is drafted during the
target's prefill the same way, the draft guessing the first token.

Each round yields control back to the caller, which streams the new tokens.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np

from coordinator.session import Session
from coordinator.workers import WorkerClient
from tandem.rpc.metrics import CoordinatorMetrics
from tandem.rpc.wire import sampling_to_proto
from tandem.spec.adaptive import MAX_K, CostModel, LoadAwareCost, choose_k, expected_tokens
from tandem.spec.draft_model import common_prefix_len
from tandem.spec.ngram import lookup_continuation
from tandem.v1 import common_pb2


@dataclass(slots=True)
class Proposal:
    base_len: int  # the history length these drafts continue
    drafts: list[int]
    probs: list[common_pb2.SparseDistribution] = field(default_factory=list)  # empty: deterministic
    guess: int | None = None  # the draft's guess of the token after all drafts (for pipelining)


class SpeculationRun:
    """Drives one session against one target replica and (optionally) one draft replica."""

    def __init__(self, session: Session, target: WorkerClient, draft: WorkerClient | None, costs: CostModel,
                 metrics: CoordinatorMetrics | None, ngram_sizes: tuple[int, int], max_context: int) -> None:
        self.s = session
        self.target = target
        self.draft = draft if session.method == "draft" else None
        self.costs = costs
        self.metrics = metrics
        self.ngram_sizes = ngram_sizes
        self.max_context = max_context
        self.seq_id = f"{session.request_id}-{uuid.uuid4().hex[:8]}"
        self.sampling = sampling_to_proto(session.sampling)
        self.draft_history: list[int] = []  # what the draft worker holds as committed history
        self.in_flight: set[asyncio.Task] = set()

    # ----- the loop ------------------------------------------------------
    async def run(self) -> AsyncIterator[None]:
        self.target.active += 1
        if self.draft is not None:
            self.draft.active += 1
        try:
            proposal = await self._prefill()
            yield
            while not self.s.finish_reason:
                proposal = await self._round(proposal)
                yield
        finally:
            self.target.active -= 1
            if self.draft is not None:
                self.draft.active -= 1
            await self._release()

    async def _prefill(self) -> Proposal | None:
        prompt = self.s.prompt_ids
        k = self._choose_k(after_tokens=1)
        early: asyncio.Task | None = None
        if self.draft is not None and k > 0 and self.s.pipelined:
            # Draft while the target prefills: its first token is a guess of the target's first token.
            early = self._spawn(self._propose(prompt, k + 2))
        t0 = time.perf_counter()
        first = await self.target.prefill(self.seq_id, prompt, self.sampling)
        self.s.stats.prefill_wait_s += time.perf_counter() - t0
        self.s.commit([first])
        if early is None:
            return None
        tokens, probs = await early
        if tokens and tokens[0] == first and len(tokens) > 1:
            return Proposal(len(self.s.history), tokens[1:-1], probs[1:-1], tokens[-1])
        return None

    async def _round(self, proposal: Proposal | None) -> Proposal | None:
        s, stats = self.s, self.s.stats
        round_start = time.perf_counter()
        k = self._choose_k(after_tokens=0)
        committed = len(s.history)
        if proposal is None or proposal.base_len != committed:
            proposal = await self._fresh_proposal(k)
        drafts, probs = proposal.drafts[:k], proposal.probs[:k]
        verify_task = self._spawn(self.target.verify(self.seq_id, committed, drafts, probs))
        ahead: asyncio.Task | None = None
        if self.draft is not None and s.pipelined and drafts and proposal.guess is not None \
                and len(drafts) == len(proposal.drafts):
            # Draft round r+1 now, betting that all of round r is accepted and the guess is right.
            ahead = self._spawn(self._propose([*s.history, *drafts, proposal.guess], k + 1))
        t0 = time.perf_counter()
        verdict = await verify_task
        verify_wait = time.perf_counter() - t0
        stats.verify_wait_s += verify_wait
        self.costs.observe_verify(len(drafts) + 1, verify_wait)
        if self.metrics:
            self.metrics.verify_latency.observe(verify_wait)
        accepted = verdict.num_accepted
        s.commit([*drafts[:accepted], verdict.next_token])
        self._record_round(len(drafts), accepted, k)

        next_proposal = None
        if ahead is not None:
            t0 = time.perf_counter()
            tokens, ahead_probs = await ahead
            stats.draft_wait_s += time.perf_counter() - t0
            if accepted == len(drafts) and verdict.next_token == proposal.guess and not s.finish_reason:
                next_proposal = Proposal(len(s.history), tokens[:-1], ahead_probs[:-1], tokens[-1] if tokens else None)
        stats.round_wall_s += time.perf_counter() - round_start
        return next_proposal

    async def _fresh_proposal(self, k: int) -> Proposal:
        """A proposal for the current history, waited for (no pipelining benefit this round)."""
        committed = len(self.s.history)
        if k == 0:
            return Proposal(committed, [])
        if self.draft is None:
            self.costs.observe_draft(0.0)  # a lookup in the coordinator: no draft cost worth counting
            lo, hi = self.ngram_sizes
            return Proposal(committed, lookup_continuation(np.asarray(self.s.history, dtype=np.int64), k, lo, hi))
        extra = 1 if self.s.pipelined else 0
        t0 = time.perf_counter()
        tokens, probs = await self._propose(self.s.history, k + extra)
        waited = time.perf_counter() - t0
        self.s.stats.draft_wait_s += waited
        self.costs.observe_draft(waited / (k + extra))
        if extra and len(tokens) == k + 1:
            return Proposal(committed, tokens[:-1], probs[:-1], tokens[-1])
        return Proposal(committed, tokens, probs)

    async def _propose(self, tokens: list[int], k: int) -> tuple[list[int], list[common_pb2.SparseDistribution]]:
        """Draft k tokens after ``tokens``, sending only what the draft does not hold yet."""
        assert self.draft is not None
        keep = common_prefix_len(self.draft_history, tokens)
        new_tokens = list(tokens[keep:])
        # Record what the draft will hold before awaiting: a later call is computed against it.
        self.draft_history = list(tokens)
        t0 = time.perf_counter()
        reply = await self.draft.propose(self.seq_id, keep, new_tokens, k, self.sampling)
        if self.metrics:
            self.metrics.draft_latency.observe(time.perf_counter() - t0)
        return list(reply.tokens), list(reply.probs)

    # ----- helpers ---------------------------------------------------------
    def _choose_k(self, after_tokens: int) -> int:
        s = self.s
        room = min(s.remaining - after_tokens, self.max_context - len(s.history) - after_tokens) - 1
        if s.method == "none" or room <= 0 or (s.method == "draft" and self.draft is None):
            return 0
        if not s.adaptive_k:
            return max(0, min(s.k_max, room))
        costs = self._round_costs()
        k = choose_k(s.tracker.rate, costs, s.k_max)
        if k > 0 and not self._catch_up_pays(k, costs):
            return 0
        return max(0, min(k, room))

    def _catch_up_pays(self, k: int, costs: LoadAwareCost) -> bool:
        """Whether drafting now repays feeding the draft what it has not seen of this sequence.

        A draft that has been left out (a new prompt, or rounds at k = 0) must first read the
        missing tokens: one long draft forward. Under load that forward holds up every stream
        sharing the machine, so it is charged once per stream; it pays only if the time the
        remaining tokens save at this k exceeds it. Without this, streams that load had pushed
        to k = 0 restart drafting near their end, when the catch-up cannot pay back.

        A lone stream always may: its catch-up delays nobody else, and the estimate (the
        draft's per-token cost, fitted on decode-sized batches where int8 works row by row)
        overstates a catch-up, which runs through the dense weights; applied alone, it kept
        single streams at k = 0 after a bad patch (measured: mean k 1.3 instead of 2.8).
        """
        if self.draft is None or costs.streams <= 1:
            return True  # n-gram lookup has nothing to catch up; a lone stream delays nobody
        behind = len(self.s.history) - common_prefix_len(self.draft_history, self.s.history)
        if behind <= MAX_K + 1:
            return True  # a draft that took part in the last round: what it lacks rides on the next Propose
        per_token_s = costs.draft_per_token_s or costs.fallback.draft_step_s
        catch_up_s = behind * per_token_s * max(1, costs.streams)
        plain_s_per_token = costs.round_seconds(0)
        spec_s_per_token = costs.round_seconds(k) / expected_tokens(self.s.tracker.rate, k)
        return self.s.remaining * (plain_s_per_token - spec_s_per_token) > catch_up_s

    def _round_costs(self) -> LoadAwareCost:
        """What a round costs at the current load, from the workers' fitted forward costs."""
        costs = LoadAwareCost(self.costs, streams=self.target.streams)
        if self.target.info is not None:
            costs.target_base_s = self.target.info.forward_base_s
            costs.target_per_token_s = self.target.info.forward_per_token_s
        if self.draft is not None and self.draft.info is not None:
            costs.draft_base_s = self.draft.info.forward_base_s
            costs.draft_per_token_s = self.draft.info.forward_per_token_s
        return costs

    def _record_round(self, drafted: int, accepted: int, k: int) -> None:
        stats = self.s.stats
        stats.rounds += 1
        stats.chosen_k.append(k)
        if self.metrics:
            self.metrics.chosen_k.observe(k)
        if drafted:
            stats.spec_rounds += 1
            stats.drafted += drafted
            stats.accepted += accepted
            self.s.tracker.observe(drafted, accepted)
            if self.metrics:
                self.metrics.accepted_len.observe(accepted)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.in_flight.add(task)
        task.add_done_callback(self.in_flight.discard)
        return task

    async def _release(self) -> None:
        """Free the KV on both workers, after any call still in flight (it could re-create the sequence)."""
        pending = list(self.in_flight)
        if pending:
            await asyncio.wait(pending, timeout=self.target.call_timeout_s)
        releases = [self.target.release(self.seq_id)]
        if self.draft is not None and self.draft_history:
            releases.append(self.draft.release(self.seq_id))
        await asyncio.shield(asyncio.gather(*releases))
