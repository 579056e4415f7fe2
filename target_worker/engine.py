"""The target worker's state and its batched step.

Per sequence it keeps the committed token history (the worker's own output
is authoritative), the sampling parameters and the request's generator. KV
invariant, as in process: the cache holds every committed token but the
last one.

A batch runs in phases, all on the model thread (the batcher's):

1. releases queued before any other call of their sequence in the batch;
2. every Prefill and Verify is checked against the state as it is (unknown
   sequence, committed_len, context, token ids, a second call of the same
   sequence, another owner's sequence, a Prefill of a live sequence that does
   not say it replaces it, draft_probs decoded and checked) and then admitted to the KV
   pool, counting exactly the blocks it would take or give back; a call that
   fails either is answered with its error and its sequence is left exactly
   as it was;
3. only then do the admitted calls change anything: histories are cut to
   committed_len, KV rolled back, ONE forward pass runs over all of them,
   the rejection sampler decides, KV is trimmed to the accepted prefix;
   a token tree (``draft_parents``) goes through the same pass, its tokens
   at positions by depth, each seeing only its ancestors; the KV of the
   kept path is then moved into place, as if it had been a chain;
4. releases queued after a call of their sequence.

Prefix caching: a new prompt starts on the KV blocks it shares with earlier
prompts (``ModelEngine.reuse_prefix``) and computes only the rest, at least its
last token (``tandem.block_pool.prefix_limit``). Once a call is decided, the
sequence's full blocks of committed tokens whose KV is in place are offered to
the cache: the prompt's, and the generated tokens' (a chat's next turn then finds
the answer it resends cached) where the engine's rows are fixed by position
(``ModelEngine.rows_fixed_by_position``: a generated token's KV is then bitwise
what a prompt holding it computes) unless ``cache_generated`` is off. A rejected
draft never reaches a cached block, as only committed tokens are offered.
Chunked prefill (``tandem/rpc/prefill_chunks.py``): while other sequences are
running, a long prompt computes one chunk per batch step beside their rows (a
lone prompt, larger chunks, so that a newcomer soon joins the batch); the
call's result is then ``Unfinished`` and the batcher queues it again, first,
until its last chunk gives the first token. A heads prompt's chunks go to the
heads as they are computed (EAGLE's KV grows with them), the proposal with the last.

A Prefill that asks for its prompt's log-probabilities (``sampling.prompt_logprobs``, completions' echo)
computes every row's logits, in steps of at most ``SCORED_ROWS_PER_STEP`` rows, and takes nothing from
the prefix cache (``tandem/prompt_logprobs.py``); each step's rows are scored as they come.

Speculation heads (``drafter``, tandem/heads): a sequence whose Prefill asked for
proposals (``propose`` > 0) gets the features of every row it commits from the
same forward pass; after the verdicts, ONE heads step for the whole batch turns
them into each call's proposal for the next round (a token tree rooted after its
next token), returned with the result (``Proposed``). EAGLE's own KV follows the
target's: extended with each committed row, rolled back and freed with it, and
cached with it: an EAGLE prompt starts on the blocks both the target's cache and
the head's hold, and the head's rows of committed tokens are offered as the target's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.attention.sdpa import ROWWISE_MAX_QUERY
from tandem.block_pool import PrefixCacheStats, prefix_limit
from tandem.engine import ForwardItem, ModelEngine
from tandem.errors import (
    InvalidRequestError,
    KVCacheExhaustedError,
    StaleSequenceError,
    UnknownSequenceError,
    check_token_ids,
)
from tandem.heads.drafters import HeadDrafter, HeadStep
from tandem.heads.proposal import HeadProposal
from tandem.penalties import adjust_logits, row_paths_of
from tandem.prompt_logprobs import SCORED_ROWS_PER_STEP, score_rows
from tandem.prompt_score_cache import SCORE_CACHE_TOKENS, PromptScoreCache
from tandem.rpc import distributions
from tandem.rpc.batcher import Unfinished
from tandem.rpc.calls import ReleaseCall
from tandem.rpc.prefill_chunks import PrefillChunks
from tandem.rpc.room_waits import QueuedPrompt, check_room_hold
from tandem.rpc.sequence_engine import (
    Run,
    SequenceEngine,
    SequenceOwnedError,
    history_runs,
)
from tandem.sampling import SamplingParams
from tandem.spec.adaptive import MAX_K
from tandem.spec.rejection import PendingVerdict, Verdict, fetch, first_token, verify, verify_tree
from tandem.spec.transport import TokenLogprob
from tandem.spec.tree import check_parents, children_of, is_chain
from tandem.structured_output import Matcher, StructuredOutput, apply_masks
from tandem.v1 import common_pb2
from target_worker.shared_prompts import PromptRead, shared_blocks, should_wait

log = logging.getLogger(__name__)

__all__ = ["PrefillCall", "VerifyCall", "ReleaseCall", "TargetEngine", "TargetSequence", "Verdict", "Prefilled",
           "Proposed"]


@dataclass(slots=True)
class PrefillCall:
    seq_id: str
    token_ids: list[int]
    sampling: SamplingParams
    prompt_len: int = 0  # a rebuild: the prompt's length, the rest was generated; 0: all of it is prompt
    owner: str = ""  # the calling coordinator's instance id (tandem.rpc.leases); "": none named
    replace: bool = False  # a rebuild: the sequence may be live here, and is replaced; else a live id is refused
    propose: int = 0  # the sequence drafts with this worker's heads: nodes of the first proposal (0: no heads)
    max_len: int = 0  # the most tokens its KV may reach (the room new sequences leave it to grow); 0: not known
    priority: int = 0  # lower goes first where the KV pool runs short (``SequenceEngine._admit``)
    arrival_time: float = 0.0  # when its request reached its coordinator (Unix seconds); 0: not said (room_waits)
    queued: tuple[QueuedPrompt, ...] = ()  # the coordinator's requests waiting behind it for room here (room_waits)
    wait_for_room_s: float = 0.0  # refused for room: held this long for room first (``tandem.rpc.batcher``); 0: not


@dataclass(slots=True)
class VerifyCall:
    seq_id: str
    committed_len: int
    draft_tokens: list[int]
    draft_probs: list[common_pb2.SparseDistribution]  # one per draft token; [] = a deterministic draft
    draft_parents: Sequence[int] = ()  # a token tree: each draft token's parent (-1: the root); () = a chain
    owner: str = ""  # the calling coordinator's instance id; it must be the sequence's owner
    propose: int = 0  # a heads sequence: nodes of the next round's proposal (0: none this round)


Call = PrefillCall | VerifyCall | ReleaseCall


@dataclass(slots=True, frozen=True)
class Prefilled:
    """A Prefill's result: the target's first token (a rebuild: the history's last, echoed)."""

    next_token: int
    reused_tokens: int = 0  # prompt tokens whose KV came from the prefix cache, not from this pass
    logprobs: list[TokenLogprob] | None = None  # asked (``sampling.logprobs``): next_token's
    forced: tuple[int, ...] = ()  # a grammar's forced tokens after next_token: the next round's sure proposal
    prompt_logprobs: list[TokenLogprob] | None = None  # asked (``sampling.prompt_logprobs``): prompt tokens 1..


@dataclass(slots=True)
class Proposed:
    """A call's result with the heads' proposal for the next round (the calls that asked, ``propose`` > 0)."""

    result: Prefilled | Verdict
    proposal: HeadProposal


@dataclass(slots=True)
class TargetSequence:
    history: list[int]
    sampling: SamplingParams
    generator: torch.Generator | None = field(default=None)
    heads: bool = False  # drafts with the worker's heads: every committed row's feature goes to them
    prefilling: PrefillCall | None = None  # a chunked Prefill under way (this call) until its last chunk has run
    reused: int = 0  # prompt tokens its Prefill took from the prefix cache
    prompt_len: int = 0  # its prompt's tokens: the only ones whose blocks it offers to the prefix cache
    prompt_tokens: frozenset[int] | None = None  # its prompt's distinct ids: a repetition penalty's, once made
    grammar: Matcher | None = None  # structured output: the grammar's state after its committed tokens
    prompt_scores: list[TokenLogprob] | None = None  # a scored prompt's scores so far, until its Prefill replies
    max_len: int = 0  # the most tokens its KV may reach (PrefillCall.max_len); 0: not known
    priority: int = 0  # PrefillCall.priority


@dataclass(slots=True)
class _Plan:
    """A checked Prefill or Verify: what it will do, computed without changing anything."""

    index: int
    call: PrefillCall | VerifyCall
    item: ForwardItem
    kv_len: int  # KV length of the sequence once the forward pass has run
    # A rebuild's runs fed (alone, no logits) before the batched pass: the prompt, then generated
    # tokens in runs short enough for the row-invariant kernels that computed them the first time.
    before: list[Run] = field(default_factory=list)
    q: distributions.DecodedRows | None = None  # decoded draft_probs (host, sparse), sampled Verify only
    children: dict[int, list[int]] | None = None  # a tree Verify: parent node -> children; None: a chain
    resumed: bool = False  # a chunked Prefill's later step: its sequence holds the chunks before
    partial: bool = False  # a chunked Prefill's step that is not its last: no logits, no verdict yet
    features: list[torch.Tensor] = field(default_factory=list)  # heads: [rows, feature] per forward, in order
    grammar: Matcher | None = None  # a structured Prefill's matcher, made while checking (a bad schema fails here)


class TargetEngine(SequenceEngine[TargetSequence, "_Plan"]):
    """Runs batches of Prefill, Verify and Release calls through one ``ModelEngine``."""

    engine: ModelEngine

    def __init__(self, engine: ModelEngine, leases=None, drafter: HeadDrafter | None = None,
                 prefill_chunk_tokens: int | None = 0, structured: StructuredOutput | None = None,
                 cache_generated: bool = True, share_prompts: bool = True, reserve_growth: bool = False) -> None:
        super().__init__(engine, leases, reserve_growth)
        self.drafter = drafter
        # Offer generated tokens' blocks to the prefix cache too, where their KV is what a prompt computes.
        self._caches_generated = cache_generated and engine.rows_fixed_by_position
        if cache_generated and not self._caches_generated:
            log.info("the prefix cache keeps prompt blocks only: on this engine (%s attention, weights not all "
                     "packed, or int8) a generated token's KV rounds otherwise than a prompt's", engine.backend.name)
        self.structured = structured  # None: requests with a response format are refused (no tokenizer)
        # None: chunks sized from the measured step cost; 0: prompts always computed whole.
        self.chunks = PrefillChunks(prefill_chunk_tokens, engine.cost_fit, engine.prompt_cost)
        # A new prompt sharing a long prefix with one being computed waits for it (target_worker/shared_prompts.py).
        self.shares_prompts = share_prompts
        self.prompt_waits = 0  # steps a new Prefill waited so, in all
        # Scored prompts' scores by block, so that the next one starts on the prefix cache too: only where a row's
        # logits are the same in a run of any length, so that a kept score is bitwise the one computed again.
        kv = engine.kv_cache
        self.score_cache = (PromptScoreCache(kv.block_size, kv.salt, max(1, SCORE_CACHE_TOKENS // kv.block_size))
                            if kv.prefix_caching and engine.rows_fixed_by_position else None)

    @property
    def heads_kind(self) -> str:
        return "" if self.drafter is None else self.drafter.kind

    @property
    def caches_generated(self) -> bool:
        return self._caches_generated

    def shared_prompt_stats(self) -> tuple[int, int]:
        """(steps new Prefills waited for a prompt being computed, blocks with kept prompt scores): read by metrics
        scrapes off the model thread, as ``PrefixCacheStats`` snapshots are (a count a batch late is as good)."""
        return self.prompt_waits, 0 if self.score_cache is None else len(self.score_cache)

    def heads_prefix_stats(self) -> PrefixCacheStats | None:
        return None if self.drafter is None else self.drafter.prefix_stats()

    def call_cost(self, call: Call) -> int:
        """Tokens a call adds to the forward pass (the scheduler's budget unit)."""
        if isinstance(call, PrefillCall):
            tokens = len(call.token_ids)
            if _scores_prompt(call):
                tokens = min(tokens, SCORED_ROWS_PER_STEP)
            return min(tokens, self.chunks.size()) if self.chunks.enabled else tokens
        if isinstance(call, VerifyCall):
            return len(call.draft_tokens) + 1
        return 0

    # ----- one batch -----------------------------------------------------
    def run_batch(self, calls: list[Call]) -> list[Prefilled | Verdict | Proposed | bool | BaseException | Unfinished]:
        """One batch step; a new Prefill that shares a long prefix with a prompt being computed waits a step
        (``Unfinished``, nothing started: ``target_worker/shared_prompts.py``)."""
        waiting = self._waiting_prefills(calls)
        if not waiting:
            return self._run_batch(calls)
        answers = iter(self._run_batch([call for i, call in enumerate(calls) if i not in waiting]))
        return [Unfinished() if i in waiting else next(answers) for i in range(len(calls))]

    def _waiting_prefills(self, calls: list[Call]) -> set[int]:
        """The new Prefills of ``calls`` that should wait for a prompt being computed (one in chunks or in scored
        steps, or an earlier new Prefill of this batch) to take what they share with it from the prefix cache."""
        kv = self.engine.kv_cache
        if not self.shares_prompts or not kv.prefix_caching:
            return set()
        reads = [PromptRead(seq.prefilling.token_ids, _score_top(seq.prefilling))
                 for seq in self.sequences.values() if seq.prefilling is not None]
        waiting: set[int] = set()
        for i, call in enumerate(calls):
            if not isinstance(call, PrefillCall) or call.prompt_len or call.seq_id in self.sequences:
                continue  # (a rebuild, a prompt's next chunk, or a call its checks will refuse)
            read = PromptRead(call.token_ids, _score_top(call))
            if not any(shared_blocks(r.tokens, call.token_ids, kv.block_size) for r in reads):
                reads.append(read)  # nothing being computed starts like it: no cache lookup to make
                continue
            cached = kv.cached_prefix_len(call.token_ids)
            if read.scored is not None and self.score_cache is not None:  # a block serves it only with kept scores
                kept = self.score_cache.lookup(call.token_ids, read.scored, len(call.token_ids))
                cached = min(cached, len(kept) + 1 if kept else 0)
            if (read.scored is None or self.score_cache is not None) and should_wait(
                    read, reads, cached, kv.block_size, self.engine.prompt_cost.per_token_s,
                    self.engine.cost_fit.base_s):
                waiting.add(i)
            else:
                reads.append(read)
        self.prompt_waits += len(waiting)
        return waiting

    def _run_batch(self, calls: list[Call]) -> list[Prefilled | Verdict | Proposed | bool | BaseException]:
        results: list[Prefilled | Verdict | Proposed | bool | BaseException | None] = [None] * len(calls)
        admitted, late = self._plan_batch(calls, results)  # phases 1-2 (tandem/rpc/sequence_engine.py)

        if admitted:  # phase 3
            for plan in admitted:
                self._apply(plan)
            self._chunk(admitted)
            admitted = self._rebuild(admitted, results)
            try:
                logits, features = self._forward([p.item for p in admitted])
                for plan, rows in zip(admitted, features):
                    if rows is not None:
                        plan.features.append(rows)
            except Exception as exc:  # noqa: BLE001 - the pass failed: each call gets the error
                for plan in admitted:
                    self._forward_failed(plan)
                    results[plan.index] = exc
            else:
                logits = self._score_prompts(admitted, logits, results)
                chunks = [p for p in admitted if p.partial and results[p.index] is None]
                for plan in chunks:
                    results[plan.index] = self._chunk_done(plan)
                done = [(p, rows) for p, rows in zip(admitted, logits) if not p.partial and results[p.index] is None]
                self._finish([p for p, _ in done], [rows for _, rows in done], results, chunks)

        self._drop_failed_chunks(calls, results)
        self._release_late(calls, late, results)  # phase 4
        return results  # type: ignore[return-value]

    # ----- chunked prefill -------------------------------------------------
    def _chunk(self, plans: list[_Plan]) -> None:
        """Cut each long new prompt to one chunk (a larger one when no other sequence is running: module doc); a
        scored prompt (``prompt_logprobs``) to ``SCORED_ROWS_PER_STEP`` rows whatever else runs, to bound the logits
        it holds."""
        prompts = [p for p in plans if isinstance(p.call, PrefillCall) and not p.call.prompt_len]  # (not rebuilds)
        prompts.sort(key=lambda p: p.call.priority)  # a higher priority takes the lone chunk first; FCFS within one
        for plan in prompts:
            if _scores_prompt(plan.call) and len(plan.item.token_ids) > SCORED_ROWS_PER_STEP:
                _cut(plan, SCORED_ROWS_PER_STEP)
        if not self.chunks.enabled:
            return
        spans = {plan.call.seq_id: (len(plan.item.token_ids), plan.kv_len - len(plan.item.token_ids))
                 for plan in prompts}  # tokens left to feed, from which position
        # While no other sequence is running, the prompts share a lone (larger) chunk, so that a newcomer waits one at
        # most; a prompt that finishes in it is not held up by the others' chunks (PrefillChunks.take_lone).
        running = any(seq.prefilling is None and s not in spans for s, seq in self.sequences.items())
        cuts = (self.chunks.take_lone([spans[p.call.seq_id] for p in prompts]) if not running else
                [self.chunks.take(*spans[p.call.seq_id]) for p in prompts])
        for plan, now in zip(prompts, cuts):
            if now < spans[plan.call.seq_id][0]:
                _cut(plan, now)

    def _score_prompts(self, plans: list[_Plan], logits: list[torch.Tensor], results: list) -> list[torch.Tensor]:
        """Each scored prompt's rows this step give its tokens' log-probabilities (``tandem.prompt_logprobs``);
        what is left per plan is the logits its decision reads (a scored prompt's last chunk: its last row)."""
        left = []
        for plan, rows in zip(plans, logits):
            seq = self.sequences.get(plan.call.seq_id)
            if not _scores_prompt(plan.call) or seq is None or seq.prompt_scores is None:
                left.append(rows)
                continue
            fed = len(plan.item.token_ids)
            start = self.engine.seq_len(plan.call.seq_id) - fed  # the first fed row's position
            scored = fed if plan.partial else fed - 1  # the prompt's last row scores the first generated token
            try:
                seq.prompt_scores.extend(score_rows(rows[:scored], seq.history[start + 1:start + 1 + scored],
                                                    seq.sampling.prompt_logprobs))
            except Exception as exc:  # noqa: BLE001 - this call fails alone
                self._forward_failed(plan)
                results[plan.index] = exc
            left.append(rows[scored:])
        return left

    def _chunk_done(self, plan: _Plan) -> Unfinished:
        """A chunk is in the KV: the prompt's full blocks so far go to the prefix cache; the call goes on."""
        seq = self.sequences[plan.call.seq_id]
        seq.prefilling = plan.call
        self._offer_committed(plan.call.seq_id, seq)
        return Unfinished()

    def _offer_committed(self, seq_id: str, seq: TargetSequence) -> None:
        """The sequence's full blocks of committed tokens in the KV go to the prefix cache: the prompt's (while
        it is computed, its chunks so far), and the generated tokens' unless ``cache_generated`` is off. The KV
        holds every committed token but the last (the module doc's invariant); generated blocks only where rows are
        fixed by position, so that each block holds what a prompt of those tokens computes."""
        self.engine.commit(seq_id, seq.history, self._cacheable(seq))

    def _cacheable(self, seq: TargetSequence) -> int:
        """How many of the sequence's first rows may be offered to the prefix cache (``_offer_committed``)."""
        generated = self._caches_generated and seq.prefilling is None
        return len(seq.history) - 1 if generated else seq.prompt_len

    def _drop_failed_chunks(self, calls: list[Call], results: list) -> None:
        """A chunked Prefill that failed (refused, or its pass failed) leaves nothing behind."""
        for call, result in zip(calls, results):
            if isinstance(call, PrefillCall) and isinstance(result, BaseException):
                seq = self.sequences.get(call.seq_id)
                if seq is not None and seq.prefilling is call:
                    self._release(call.seq_id)

    def _forward(self, items: list[ForwardItem]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """One forward pass; the heads sequences' features too when this worker has heads."""
        if self.drafter is None:
            return self.engine.forward(items), [None] * len(items)
        return self.engine.forward_with_features(items, self.drafter.spec)

    def _check(self, index: int, call: PrefillCall | VerifyCall) -> _Plan:
        if not call.seq_id:
            raise InvalidRequestError("seq_id is empty")
        if call.propose < 0:
            raise InvalidRequestError(f"propose must be >= 0 nodes, got {call.propose}")
        if call.propose and self.drafter is None:
            raise InvalidRequestError("this target worker serves no speculation heads (start it with --heads); "
                                      "choose another speculation method")
        if isinstance(call, PrefillCall):
            if not call.token_ids:
                raise InvalidRequestError("token_ids is empty: nothing to prefill")
            check_room_hold(call.wait_for_room_s)
            check_token_ids("token_ids", call.token_ids, self.vocab_size)
            check_token_ids("logit_bias", (t for t, _ in call.sampling.logit_bias), self.vocab_size)
            if len(call.token_ids) >= self.max_context:
                raise InvalidRequestError(
                    f"prompt of {len(call.token_ids)} tokens exceeds the context of {self.max_context}"
                )
            seq = self.sequences.get(call.seq_id)
            if seq is not None and seq.prefilling is call:  # its next chunk, after those in the KV
                done = self.engine.seq_len(call.seq_id)
                left = list(call.token_ids[done:])
                item = ForwardItem(call.seq_id, left, num_logits=len(left) if _scores_prompt(call) else 1,
                                   features=seq.heads, prompt=True)
                return _Plan(index, call, item, kv_len=len(call.token_ids), resumed=True)
            if seq is not None and not call.replace:
                # Another request's id, or a stray repeat: replacing it would hand one request's state to another.
                raise SequenceOwnedError(f"sequence {call.seq_id!r} is live on this target: a Prefill does not "
                                         "replace it unless it says it rebuilds it (replace)")
            heads = call.propose > 0
            grammar = self._grammar(call)
            if not call.prompt_len:
                tokens = list(call.token_ids)
                item = ForwardItem(call.seq_id, tokens, num_logits=len(tokens) if _scores_prompt(call) else 1,
                                   features=heads, prompt=True)
                return _Plan(index, call, item, kv_len=len(call.token_ids), grammar=grammar)
            # A rebuild: the whole history; the KV of all but its last token, and nothing sampled.
            if not 0 < call.prompt_len < len(call.token_ids):
                raise InvalidRequestError(
                    f"prompt_len {call.prompt_len}: a rebuild needs 1..{len(call.token_ids) - 1} (the history "
                    f"holds at least one generated token)")
            *before, last = history_runs(call.token_ids[:-1], 0, call.prompt_len)
            item = ForwardItem(call.seq_id, last.tokens, num_logits=0, features=heads, prompt=last.prompt)
            return _Plan(index, call, item, kv_len=len(call.token_ids) - 1, before=before, grammar=grammar)
        seq = self.sequences.get(call.seq_id)
        if seq is None:
            raise UnknownSequenceError(f"target holds no sequence {call.seq_id!r}")
        k = len(call.draft_tokens)
        if not 1 <= call.committed_len <= len(seq.history):
            raise StaleSequenceError(
                f"sequence {call.seq_id!r}: committed_len {call.committed_len} outside 1..{len(seq.history)}"
            )
        if call.committed_len + k >= self.max_context:
            raise InvalidRequestError(f"sequence {call.seq_id!r} would exceed the context of {self.max_context}")
        check_token_ids("draft_tokens", call.draft_tokens, self.vocab_size)
        tree = bool(call.draft_parents) and not is_chain(call.draft_parents)
        if tree and k + 1 > ROWWISE_MAX_QUERY:
            raise InvalidRequestError(f"a token tree holds at most {ROWWISE_MAX_QUERY - 1} draft tokens, got {k}")
        if call.draft_parents:
            try:
                check_parents(call.draft_parents, k)
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from None
        if call.draft_probs and len(call.draft_probs) != k:
            raise InvalidRequestError(
                f"draft_probs must be empty or hold one distribution per draft token: {len(call.draft_probs)} for {k}"
            )
        q = None
        if call.draft_probs and not seq.sampling.is_greedy:  # greedy verification never reads q
            q = distributions.decode_sparse(call.draft_probs, self.vocab_size, call.draft_tokens)  # checked on the host
            if not all(prob > 0 for prob in q.prob_of(call.draft_tokens)):
                raise InvalidRequestError("a draft token has probability 0 under the distribution it was drawn from")
        tokens = [seq.history[call.committed_len - 1], *call.draft_tokens]
        if call.propose and not seq.heads:
            raise InvalidRequestError(f"sequence {call.seq_id!r} did not start with heads (its Prefill's propose "
                                      "was 0): it cannot ask them for proposals")
        if not tree:
            item = ForwardItem(call.seq_id, tokens, num_logits=k + 1, features=seq.heads)
            return _Plan(index, call, item, kv_len=call.committed_len + k, q=q)
        # Row 0 is the root (the last committed token), row i + 1 draft node i.
        rows = [-1, *(p + 1 for p in call.draft_parents)]
        item = ForwardItem(call.seq_id, tokens, num_logits=k + 1, parents=rows, features=seq.heads)
        return _Plan(index, call, item, kv_len=call.committed_len + k, q=q, children=children_of(call.draft_parents))

    def _grammar(self, call: PrefillCall) -> Matcher | None:
        """A structured request's matcher, through a rebuild's generated tokens; None for a free one."""
        if not call.sampling.structured:
            return None
        if self.structured is None:
            raise InvalidRequestError("response_format: this target was started without its tokenizer and cannot "
                                      "enforce structured output")
        return self.structured.matcher(call.sampling, call.token_ids[call.prompt_len:] if call.prompt_len else ())

    def _apply(self, plan: _Plan) -> None:
        """The admitted call's changes before the forward pass."""
        call = plan.call
        if plan.resumed:
            return
        if isinstance(call, PrefillCall):
            self._free(call.seq_id)  # a rebuild (replace) replaces the old state; the owner keeps the sequence
            generator = None if call.sampling.is_greedy else call.sampling.make_generator(self.engine.device)
            self.sequences[call.seq_id] = TargetSequence(list(call.token_ids), call.sampling, generator,
                                                         heads=call.propose > 0,
                                                         prompt_len=call.prompt_len or len(call.token_ids),
                                                         grammar=plan.grammar,
                                                         prompt_scores=[] if _scores_prompt(call) else None,
                                                         max_len=call.max_len, priority=call.priority)
            self._reuse_prefix(plan)
        else:
            seq = self.sequences[call.seq_id]
            del seq.history[call.committed_len:]
            if seq.grammar is not None:
                seq.grammar.rollback_to(call.committed_len - seq.prompt_len)
            self.engine.rollback(call.seq_id, call.committed_len - 1)
            if self.drafter is not None:
                self.drafter.rollback(call.seq_id, call.committed_len - 1)

    def _reuse_prefix(self, plan: _Plan) -> None:
        """Start the Prefill's sequence on its tokens' cached blocks, and feed only the rest.

        What is left of the prompt (at least its last token: ``prefix_limit``) is fed as prompt tokens, so
        its rows are the ones the prompt computed in one run has. A rebuild may find its generated tokens'
        blocks too (preempted on this target, they stayed cached), where rows are fixed by position: what is
        left of its history, at least the token before its last, is fed as it was first computed
        (``history_runs``).
        """
        call = plan.call
        if call.prompt_len and self.engine.rows_fixed_by_position:
            limit = prefix_limit(len(call.token_ids) - 1)  # a rebuild's KV: all but its last token
        else:  # (elsewhere a cached block holds prompt rows, which a generated token's row is not)
            limit = prefix_limit(call.prompt_len or len(call.token_ids))
        if plan.item.features:  # EAGLE's layer has a row per target row: the rows fed are those both caches lack
            limit = min(limit, self.drafter.cached_prefix_len(call.token_ids))
        kept_scores: list[TokenLogprob] = []
        if _scores_prompt(call):  # every row's logits are asked for: a cached block serves only with its scores
            kept_scores = self._kept_scores(call, plan, limit)
            limit = len(kept_scores) + 1 if kept_scores else 0
        reused = self.engine.reuse_prefix(call.seq_id, call.token_ids, limit=limit)
        if kept_scores and reused:
            reused = self._score_from(plan, reused, kept_scores)
        if plan.item.features:
            self.drafter.start(call.seq_id, call.token_ids, reused)
        # the reply says so once the prompt is computed: prompt tokens only
        self.sequences[call.seq_id].reused = min(reused, call.prompt_len or reused)
        if not reused:
            return
        if not call.prompt_len:
            plan.item.token_ids = call.token_ids[reused:]
            return
        *plan.before, last = history_runs(call.token_ids[:-1], reused, call.prompt_len)
        plan.item.token_ids, plan.item.prompt = last

    def _kept_scores(self, call: PrefillCall, plan: _Plan, limit: int) -> list[TokenLogprob]:
        """The kept scores of the cached blocks a scored prompt may start on (``tandem.prompt_score_cache``); none for
        EAGLE's prompts, whose head needs every row's feature."""
        if self.score_cache is None or plan.item.features:
            return []
        return self.score_cache.lookup(call.token_ids, call.sampling.prompt_logprobs, limit)

    def _score_from(self, plan: _Plan, reused: int, kept_scores: list[TokenLogprob]) -> int:
        """A scored prompt started on ``reused`` cached tokens: the last of them is fed again, since its row scores
        the first token fed and the cache keeps no row; the tokens before it take their kept scores. The tokens
        taken from the cache."""
        call, seq = plan.call, self.sequences[plan.call.seq_id]
        pool = self.engine.kv_cache.pool
        last = self.engine.kv_cache.sequence(call.seq_id).block_ids[-1]
        pool.hold(last)  # held twice, the rollback writes into a private copy: the cached block stays for the others
        try:
            self.engine.rollback(call.seq_id, reused - 1)
        except KVCacheExhaustedError:  # no block for that copy: the prompt is computed whole, as uncached
            self.engine.release(call.seq_id)
            self.engine.reuse_prefix(call.seq_id, call.token_ids, limit=0)
            return 0
        finally:
            pool.release(last)
        seq.prompt_scores = kept_scores[:reused - 1]
        plan.item.token_ids = call.token_ids[reused - 1:]
        plan.item.num_logits = len(plan.item.token_ids)
        return reused - 1

    def _rebuild(self, plans: list[_Plan], results: list) -> list[_Plan]:
        """Feed each rebuild's earlier runs, one sequence at a time; the plans still to run."""
        ready = []
        for plan in plans:
            try:
                for run in plan.before:
                    _, features = self._forward([ForwardItem(plan.call.seq_id, run.tokens, num_logits=0,
                                                             features=plan.item.features, prompt=run.prompt)])
                    if features[0] is not None:
                        plan.features.append(features[0])
                ready.append(plan)
            except Exception as exc:  # noqa: BLE001 - this rebuild fails alone
                self._forward_failed(plan)
                results[plan.index] = exc
        return ready

    def _forward_failed(self, plan: _Plan) -> None:
        """Leave a consistent state: a prefill is forgotten; a verify stays at its committed_len."""
        call = plan.call
        if isinstance(call, PrefillCall):
            self._release(call.seq_id)
        elif self.engine.seq_len(call.seq_id) > call.committed_len - 1:
            self.engine.rollback(call.seq_id, call.committed_len - 1)

    def _finish(self, plans: list[_Plan], logits: list[torch.Tensor], results: list,
                chunks: Sequence[_Plan] = ()) -> None:
        """Decide every call on the device, read all the verdicts with ONE copy, then apply each.

        That copy is the batch's one host sync after the forward pass: what each call keeps
        decides its KV and its reply. A call whose decision or application fails fails alone.
        ``chunks``: the batch's chunked Prefills that are not done yet (their rows still go to the heads).
        """
        decided: list[tuple[_Plan, Verdict | PendingVerdict]] = []
        for plan, rows in zip(plans, logits):
            try:
                decided.append((plan, self._decide(plan, rows)))
            except Exception as exc:  # noqa: BLE001
                self._forward_failed(plan)
                results[plan.index] = exc
        try:
            verdicts = fetch([verdict for _, verdict in decided])
        except Exception as exc:  # noqa: BLE001 - the read failed: every call still deciding gets the error
            for plan, _ in decided:
                self._forward_failed(plan)
                results[plan.index] = exc
            return
        committed: list[tuple[_Plan, Verdict]] = []
        for (plan, _), verdict in zip(decided, verdicts):
            try:
                results[plan.index] = self._commit(plan, verdict)
                committed.append((plan, verdict))
            except Exception as exc:  # noqa: BLE001
                self._forward_failed(plan)
                results[plan.index] = exc
        self._propose(committed, chunks, results)

    def _propose(self, committed: list[tuple[_Plan, Verdict]], chunks: Sequence[_Plan], results: list) -> None:
        """One heads step for the batch's heads sequences: their committed rows in, next proposals out (a chunk
        of a heads prompt: its rows in, no proposal yet)."""
        if self.drafter is None:
            return
        steps, plans = [], []
        for plan, verdict in [*committed, *((p, None) for p in chunks)]:
            if plan.features:
                steps.append(self._head_step(plan, verdict))
                plans.append(plan)
        if not steps:
            return
        for plan, proposal in zip(plans, self.drafter.step(steps)):
            if plan.call.propose and not plan.partial:
                results[plan.index] = Proposed(results[plan.index], proposal)
            seq = self.sequences[plan.call.seq_id]  # the head's rows for the rows just committed: as the target's
            self.drafter.commit(plan.call.seq_id, seq.history, self._cacheable(seq))

    def _head_step(self, plan: _Plan, verdict: Verdict | None) -> HeadStep:
        """The rows a call committed to the KV, their features, and the token after each (``verdict`` None: a
        chunk of a prompt, which proposes nothing yet)."""
        call = plan.call
        features = torch.cat(plan.features) if len(plan.features) > 1 else plan.features[0]  # [rows fed, F]
        if isinstance(call, PrefillCall):  # every row fed is committed: the prompt (or the rebuilt history)
            seq = self.sequences[call.seq_id]
            # The rows fed start past the prefix cache's and the earlier chunks' (the KV before this pass).
            start = self.engine.seq_len(call.seq_id) - features.shape[0]
            tokens = seq.history[start + 1:start + 1 + features.shape[0]]  # a prompt's last row: then b
            return HeadStep(call.seq_id, start, features, tokens, 0 if plan.partial else call.propose)
        accepted = [call.draft_tokens[n] for n in verdict.accepted_nodes]
        if plan.children is None:
            kept = features[: verdict.num_accepted + 1]
        else:  # the root's row, then the kept nodes' rows
            rows = [0, *(n + 1 for n in verdict.accepted_nodes)]
            kept = features[torch.tensor(rows, device=features.device)]
        return HeadStep(call.seq_id, call.committed_len - 1, kept, [*accepted, verdict.next_token], call.propose)

    def _decide(self, plan: _Plan, logits: torch.Tensor) -> Verdict | PendingVerdict:
        """The call's outcome, computed where the logits are and not read back (a Prefill: 0 drafts)."""
        call = plan.call
        seq = self.sequences[call.seq_id]
        if isinstance(call, PrefillCall) and call.prompt_len:
            return Verdict(0, seq.history[-1])  # a rebuild: the history is known, nothing to sample
        if seq.generator is not None:  # seeded (rejection rule): this position's draws, wherever it was rebuilt
            seq.sampling.seed_at(seq.generator, plan.kv_len if isinstance(call, PrefillCall) else call.committed_len)
        raw = logits  # log-probabilities are the raw logits'; the decision takes penalties, bias and grammar
        if seq.sampling.adjusts_logits or seq.grammar is not None:
            # Each row for its own context: the committed text and the drafts on the path to the row.
            paths = [[]] if isinstance(call, PrefillCall) else row_paths_of(call.draft_tokens, call.draft_parents)
            if seq.sampling.adjusts_logits:
                logits = self._adjusted(seq, logits, paths)
            if seq.grammar is not None:
                logits = apply_masks(logits, seq.grammar.masks(paths))
        if isinstance(call, PrefillCall):
            return first_token(logits, seq.sampling, seq.generator, position=plan.kv_len, raw=raw)
        # (a seeded request's verdict is its own draws: the draft's q, checked when decoded, goes unused)
        q = None if plan.q is None or seq.sampling.exact_seed else plan.q.dense(logits.device)
        # position: a seeded request's rows take plain decoding's draws at their positions (rejection's doc)
        if plan.children is None:
            return verify(logits, call.draft_tokens, q, seq.sampling, seq.generator, position=call.committed_len,
                          raw=raw)
        return verify_tree(logits, call.draft_tokens, plan.children, q, seq.sampling, seq.generator,
                           position=call.committed_len, raw=raw)

    def _adjusted(self, seq: TargetSequence, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """``[rows, vocab]`` logits with the request's penalties and bias, each row for its own context: the
        committed history (cut to the call's committed_len already) and the drafts on the path to it."""
        if seq.prompt_tokens is None:
            seq.prompt_tokens = frozenset(seq.history[: seq.prompt_len])
        return adjust_logits(logits, seq.sampling, seq.prompt_tokens, seq.history[seq.prompt_len:], paths)

    def _free(self, seq_id: str) -> bool:
        if self.drafter is not None:
            self.drafter.release(seq_id)
        return super()._free(seq_id)

    def _commit(self, plan: _Plan, verdict: Verdict) -> Prefilled | Verdict:
        """Apply a read verdict: the history, and the KV cut (or moved) to what was kept; the committed
        blocks are offered to the prefix cache."""
        call = plan.call
        seq = self.sequences[call.seq_id]
        if isinstance(call, PrefillCall):
            seq.prefilling = None
            if not call.prompt_len:
                seq.history.append(verdict.next_token)
                if seq.grammar is not None:
                    seq.grammar.commit([verdict.next_token])
            self._offer_committed(call.seq_id, seq)
            scores, seq.prompt_scores = seq.prompt_scores, None
            if scores and self.score_cache is not None:
                self.score_cache.store(call.token_ids, call.sampling.prompt_logprobs, scores)
            return Prefilled(verdict.next_token, seq.reused, verdict.logprobs, tuple(self._forced(seq)), scores)
        if plan.children is None:
            self.engine.rollback(call.seq_id, call.committed_len + verdict.num_accepted)
        else:
            # The root's row (at committed_len - 1) stays; the kept nodes' KV moves to the positions a chain had.
            self.engine.keep_path(call.seq_id, call.committed_len - 1, [0, *(n + 1 for n in verdict.accepted_nodes)])
        kept = [*(call.draft_tokens[n] for n in verdict.accepted_nodes), verdict.next_token]
        seq.history.extend(kept)
        self._offer_committed(call.seq_id, seq)
        if seq.grammar is not None:
            seq.grammar.commit(kept)
            verdict.forced = self._forced(seq)
        return verdict

    def _forced(self, seq: TargetSequence) -> list[int]:
        """What the sequence's grammar forces after its history (the tokens of the only text it allows next): the
        coordinator proposes them next, and the target keeps them unless it spells that text otherwise, where a
        draft could miss them (a special token past a lean draft's vocabulary, a key's last piece). Within the
        room its context has left."""
        if seq.grammar is None:
            return []
        return seq.grammar.forced(min(MAX_K, self.max_context - len(seq.history) - 1))

    def warmup(self) -> None:
        """The engine's own warm-up (kernels, cost fit), then the Prefill, Verify (chain and tree) and Release paths;
        the tokenizer's view for structured output is read now (2.7 s for Qwen's), not on the first such request."""
        self.engine.warmup()
        if self.structured is not None:
            self.structured.prepare()
        seq = "__warmup__"
        greedy, sampled = SamplingParams(), SamplingParams(temperature=1.0, seed=0)
        drafts = [1, 2, 3, 4]
        q = torch.nn.functional.one_hot(torch.tensor(drafts, device=self.engine.device), self.vocab_size).float()
        for sampling, probs in ((greedy, []), (sampled, distributions.encode_distributions(q))):
            results = self.run_batch([PrefillCall(seq, [1, 2, 3, 4], sampling)])
            results += self.run_batch([VerifyCall(seq, 5, drafts, probs)])
            committed = len(self.sequences[seq].history) if seq in self.sequences else 5
            results += self.run_batch([VerifyCall(seq, committed, drafts, probs, [-1, 0, -1, 2]), ReleaseCall(seq)])
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise failed[0]
        if self.drafter is not None:  # the heads' path: features, a proposal, their KV extended and freed
            results = self.run_batch([PrefillCall(seq, [1, 2, 3, 4], greedy, propose=4)])
            proposal = results[0].proposal if isinstance(results[0], Proposed) else None
            if proposal is not None:
                results += self.run_batch([VerifyCall(seq, 5, proposal.tokens, [], proposal.parents, propose=4)])
            results += self.run_batch([ReleaseCall(seq)])
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise failed[0]
            if not proposal or not isinstance(results[1], Proposed) or not results[1].proposal.tokens:
                # A drafter logs and swallows its errors while serving (a round goes on without drafts);
                # at start a broken set of heads must stop the worker instead of serving without them.
                raise RuntimeError(f"the {self.drafter.kind} heads proposed nothing at warm-up: see the log above")


def _score_top(call: PrefillCall) -> int | None:
    """A scored prompt's top count; None for a plain one."""
    return call.sampling.prompt_logprobs if _scores_prompt(call) else None


def _scores_prompt(call: Call) -> bool:
    """Whether the call is a prompt's Prefill that asked for its tokens' log-probabilities (not a rebuild)."""
    return isinstance(call, PrefillCall) and not call.prompt_len and call.sampling.prompt_logprobs is not None


def _cut(plan: _Plan, tokens: int) -> None:
    """Feed only the first ``tokens`` of the plan's prompt this step (a chunk: no decision yet)."""
    plan.item.token_ids = plan.item.token_ids[:tokens]
    plan.item.num_logits = tokens if _scores_prompt(plan.call) else 0
    plan.partial = True
