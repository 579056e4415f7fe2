"""The speculation loop in one process: the worker engines behind batchers, no gRPC in between.

``SpeculativeGenerator`` runs ``tandem.spec.loop.SpeculationLoop`` (the loop
the coordinator runs) over the very engines the workers run
(``target_worker.engine.TargetEngine``, ``draft_worker.engine.DraftEngine``),
each behind a ``Batcher`` as in a worker process. Both batchers run their
batches on the CALLING thread (the one that loaded the engines), one at a
time: in process the draft and the target take turns, as they must on a
machine whose cores one forward pass already fills, and a second computing
thread would cost every forward OpenMP wake-ups (``tandem.compute_thread``).
Requests given together run concurrently, and their calls share batched
forward passes.

This module composes the role packages' engines; it is the in-process
counterpart of ``tandem.cluster``, which composes their processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from draft_worker.engine import DraftEngine, ProposeCall
from tandem.compute_thread import CallingThreadExecutor
from tandem.engine import ModelEngine
from tandem.errors import ContextLengthError, InvalidRequestError, check_token_ids, token_count_text
from tandem.heads.drafters import HeadDrafter
from tandem.kv_admission import KVAdmission
from tandem.rpc.batcher import Batcher
from tandem.rpc.calls import ReleaseCall
from tandem.sampling_params import SamplingParams
from tandem.spec.adaptive import IN_FLIGHT_TOKENS, CostModel, MatchRates
from tandem.spec.heads_payoff import HeadsVerdicts
from tandem.spec.loop import SpeculationLoop
from tandem.spec.options import SpecOptions
from tandem.spec.request import GenerationStats, RequestState, StopConditions
from tandem.spec.transport import Drafted, FittedCost, Prefilled, TokenLogprob, TreeProposal, Verified
from tandem.structured_output import StructuredOutput
from target_worker.engine import PrefillCall, Proposed, TargetEngine, VerifyCall

TOKEN_BUDGET = 4096  # most tokens in one batched forward pass, as a worker's default


@dataclass(slots=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    k_max: int | None = None  # None: the generator's SpecOptions.k_max
    adaptive_k: bool | None = None  # None: the generator's SpecOptions.adaptive_k
    prediction_ids: list[int] = field(default_factory=list)  # what the answer may repeat (tandem.spec.prediction)
    # Called with the tokens each step commits (the prefill's first, then each round's), as they are committed:
    # what `tandem generate` streams in process. It runs on the generator's event loop, so it must not block.
    on_tokens: Callable[[list[int]], None] | None = None


@dataclass(slots=True)
class GenerationResult:
    token_ids: list[int]  # generated tokens only (a stop token that ended the run included)
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens)
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # asked (``sampling.logprobs``): the target's, one per token
    prompt_logprobs: list[TokenLogprob] | None = None  # asked (``sampling.prompt_logprobs``): prompt tokens 1..


def _fitted(engine: ModelEngine) -> FittedCost | None:
    fit = engine.cost_fit
    if not fit.ready:
        return None
    return FittedCost(fit.base_s, fit.per_token_s, fit.last_base_s, fit.last_per_token_s,
                      engine.prompt_cost.per_token_s)


class LocalTarget:
    """``Verifier`` over a ``TargetEngine`` in this process."""

    def __init__(self, engine: TargetEngine, batcher: Batcher) -> None:
        self.engine = engine
        self.batcher = batcher

    @property
    def streams(self) -> int:
        return self.engine.num_sequences

    def fitted_cost(self) -> FittedCost | None:
        return _fitted(self.engine.engine)

    async def prefill(self, seq_id: str, token_ids: list[int], sampling: SamplingParams, prompt_len: int = 0,
                      propose: int = 0, wait_for_room_s: float = 0.0) -> Prefilled:
        # (wait_for_room_s: nothing is refused for room in process, where requests reserve their room up front)
        result = await self.batcher.submit(PrefillCall(seq_id, token_ids, sampling, prompt_len, propose=propose))
        proposal = None
        if isinstance(result, Proposed):
            result, proposal = result.result, TreeProposal(result.proposal.tokens, result.proposal.parents)
        return Prefilled(result.next_token, proposal, result.reused_tokens, result.logprobs, result.forced,
                         result.prompt_logprobs)

    async def verify(self, seq_id: str, committed_len: int, draft_tokens: list[int],
                     draft_probs: Sequence[Any], draft_parents: Sequence[int] = (), propose: int = 0) -> Verified:
        result = await self.batcher.submit(
            VerifyCall(seq_id, committed_len, draft_tokens, list(draft_probs), list(draft_parents), propose=propose))
        proposal = None
        if isinstance(result, Proposed):
            result, proposal = result.result, TreeProposal(result.proposal.tokens, result.proposal.parents)
        return Verified(result.accepted_nodes, result.next_token, proposal, result.logprobs, result.forced)

    async def release(self, seq_id: str) -> None:
        await self.batcher.submit(ReleaseCall(seq_id))
        self.batcher.forget(seq_id)


class LocalDraft:
    """``DraftChannel`` over a ``DraftEngine`` in this process."""

    def __init__(self, engine: DraftEngine, batcher: Batcher) -> None:
        self.engine = engine
        self.batcher = batcher

    def fitted_cost(self) -> FittedCost | None:
        return _fitted(self.engine.engine)

    def cached_prefix(self, token_ids: Sequence[int]) -> int:
        return self.engine.engine.kv_cache.cached_prefix_len(token_ids)

    def sequence_room(self) -> int | None:
        return pool_room(self.engine.engine)

    async def propose(self, seq_id: str, committed_len: int, new_tokens: list[int], k: int,
                      sampling: SamplingParams, alternatives: int = 0, prompt_len: int = 0,
                      verified_len: int = 0, stop_below: float = 0.0) -> Drafted:
        reply = await self.batcher.submit(ProposeCall(seq_id, committed_len, new_tokens, k, sampling, alternatives,
                                                      prompt_len, verified_len=verified_len,
                                                      stop_below=stop_below))
        return Drafted(reply.tokens, reply.probs, reply.alternatives)

    async def release(self, seq_id: str) -> None:
        await self.batcher.submit(ReleaseCall(seq_id))
        self.batcher.forget(seq_id)


class SpeculativeGenerator:
    """Runs requests to completion with a target engine and, for draft methods, a draft engine."""

    def __init__(self, target: ModelEngine, draft: ModelEngine | None = None,
                 options: SpecOptions | None = None, costs: CostModel | None = None,
                 heads: HeadDrafter | None = None, prefill_chunk_tokens: int | None = 0,
                 structured: StructuredOutput | None = None) -> None:
        """``structured``: the target's tokenizer for llguidance (requests with a JSON schema need it)."""
        self.options = options or SpecOptions("none", k_max=0)
        if self.options.uses_draft and draft is None:
            raise InvalidRequestError(f"method {self.options.method!r} needs a draft model")
        if self.options.uses_heads and heads is None:
            raise InvalidRequestError(f"method {self.options.method!r} needs the target's heads (--heads)")
        if draft is not None and draft.config.vocab_size != target.config.vocab_size:
            raise InvalidRequestError(
                f"draft vocabulary ({draft.config.vocab_size}) differs from the target's ({target.config.vocab_size})")
        for engine in (target, draft):  # adaptive k and the heads' budget price rounds by the fitted forward
            if engine is not None and engine.cost_fit.per_token_s == 0:  # cost; a worker seeds it at warm-up too
                engine.warmup()
        self.target = TargetEngine(target, drafter=heads, prefill_chunk_tokens=prefill_chunk_tokens,
                                   structured=structured)
        self.draft = DraftEngine(draft) if draft is not None and self.options.uses_draft else None
        self.costs = costs or CostModel()
        self.match_rates = MatchRates()  # acceptance per kind of n-gram match, over this generator's requests
        self.heads_verdicts = HeadsVerdicts()  # which way (heads or not) its requests found faster
        self.max_len = target.config.max_position_embeddings
        self._ids = itertools.count()
        self._model_thread = CallingThreadExecutor()  # the engines' own thread (tandem.compute_thread)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        for r in requests:
            if len(r.prompt_ids) + r.max_new_tokens > self.max_len:
                raise ContextLengthError(  # (worded as the coordinator words it, as OpenAI and vLLM do)
                    f"this model's maximum context length is {self.max_len} tokens, and the prompt is "
                    f"{token_count_text(len(r.prompt_ids))} with max_new_tokens {r.max_new_tokens} "
                    f"({len(r.prompt_ids)} + {r.max_new_tokens} > {self.max_len}): shorten the prompt or ask for "
                    f"fewer tokens")
            check_token_ids("prompt", r.prompt_ids, self.target.vocab_size)
            check_token_ids("prediction", r.prediction_ids, self.target.vocab_size)
            self._check_room(r)
        states = [RequestState(r.prompt_ids, r.sampling, StopConditions(r.max_new_tokens, r.stop_token_ids),
                               prediction=r.prediction_ids)
                  for r in requests]
        asyncio.run(self._run(requests, states))
        return [GenerationResult(s.generated, s.finish_reason or "length", s.stats, s.logprobs, s.prompt_logprobs)
                for s in states]

    async def _run(self, requests: list[GenerationRequest], states: list[RequestState]) -> None:
        target_batcher = Batcher(self.target.run_batch, self.target.call_cost, TOKEN_BUDGET,
                                 executor=self._model_thread)
        target = LocalTarget(self.target, target_batcher)
        draft = None
        batchers = [target_batcher]
        if self.draft is not None:
            draft_batcher = Batcher(self.draft.run_batch, self.draft.call_cost, TOKEN_BUDGET,
                                    executor=self._model_thread)
            draft = LocalDraft(self.draft, draft_batcher)
            batchers.append(draft_batcher)
        pools = [self.target.engine.kv_cache, *([self.draft.engine.kv_cache] if self.draft is not None else [])]
        admission = KVAdmission(pools)

        async def run(loop: SpeculationLoop, r: GenerationRequest) -> None:
            async with admission.hold(len(r.prompt_ids), r.max_new_tokens):
                sent = 0
                async for _ in loop.run():
                    if r.on_tokens is not None and loop.state.num_generated > sent:
                        new = loop.state.generated[sent:]
                        sent = loop.state.num_generated
                        r.on_tokens(new)

        for b in batchers:
            b.start()
        tasks: list[asyncio.Task] = []
        try:
            loops = [
                SpeculationLoop(state, f"seq-{next(self._ids)}", self._options_for(r), target, draft, self.costs,
                                self.max_len, match_rates=self.match_rates, heads_verdicts=self.heads_verdicts)
                for r, state in zip(requests, states)
            ]
            tasks = [asyncio.ensure_future(run(loop, r)) for loop, r in zip(loops, requests)]
            await asyncio.gather(*tasks)
        finally:
            # One request failed (or the call was cancelled): the others stop, and release their KV through the
            # batchers, so those must still run until every loop has ended (stopped first, the releases waited
            # on them forever and generate() hung instead of raising).
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for b in batchers:
                await b.stop()

    def _check_room(self, r: GenerationRequest) -> None:
        """Refuse a request longer than a KV pool holds for one sequence: admitted alone, it would run until its
        pool ran out and fail then (the coordinator refuses the same up front, ``sequence_room``)."""
        engines = [("target", self.target.engine), *([("draft", self.draft.engine)] if self.draft is not None else [])]
        for role, engine in engines:
            room = pool_room(engine)
            if len(r.prompt_ids) + r.max_new_tokens > room:
                raise InvalidRequestError(
                    f"prompt ({token_count_text(len(r.prompt_ids))}) + max_new_tokens ({r.max_new_tokens}) is more "
                    f"than the {role}'s KV cache holds for one sequence ({room} tokens; its kv_cache_tokens)")

    def _options_for(self, r: GenerationRequest) -> SpecOptions:
        opts = self.options
        k_max = opts.k_max if r.k_max is None else r.k_max
        adaptive = opts.adaptive_k if r.adaptive_k is None else r.adaptive_k
        if (k_max, adaptive) == (opts.k_max, opts.adaptive_k):
            return opts
        return dataclasses.replace(opts, k_max=k_max, adaptive_k=adaptive)


def pool_room(engine: ModelEngine) -> int:
    """The most tokens one sequence may reach in ``engine``'s KV pool: all of it, less a round in flight."""
    return engine.kv_cache.num_blocks * engine.kv_cache.block_size - IN_FLIGHT_TOKENS
