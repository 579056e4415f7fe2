"""The draft worker's state and its batched Propose step.

Per sequence the draft keeps ONE record (``DraftSequence``): the tokens it
holds (the history as last sent, plus the drafts it fed itself) and the
request's generator. Its KV cache always holds a prefix of those tokens (all
of them right after drafting; a Propose with k = 0 only records).

A Propose keeps the first ``committed_len`` tokens, appends ``new_tokens``
and drafts ``k`` more: the cache is rolled back to the longest prefix it
shares with the new tokens (rejected guesses vanish exactly), what is new is
fed, then k decode steps run. All sequences of a batch share each step's
forward pass; a sequence whose k is reached leaves the batch.

What is new is fed as the target read it (``history_runs``, given the
call's ``prompt_len``): the prompt as one run (the draft's prefill), the
generated tokens in short runs. A first Propose after the target's Prefill
holds the prompt and the target's first token: fed as one run, that token
would go through a prompt chunk's kernels on the draft and a verification
row's on the target, and a draft of the target's own model would sometimes
disagree with it by a rounding.

Sampled drafts: each step's q rows are encoded for the wire once
(``distributions.encode_for_sampling``), each token is drawn from exactly
what those messages decode to, and the reply carries those very messages,
so the target's acceptance test uses the q each token was drawn from.

Prefix caching: a new sequence's first Propose starts on the KV blocks its
prompt shares with earlier prompts (``ModelEngine.reuse_prefix``, leaving at
least its last token to compute: ``prefix_limit``) and feeds the rest; once
drafted, the full blocks of what the call says is committed are offered to the
cache: its prompt, and its first ``verified_len`` tokens (the target's own
text, which a conversation's next turn resends) where the engine's rows are
fixed by position or its weights are int8 (``caches_generated``). Never the
tokens after those: pipelined guesses the target has not verified, or this
draft's own drafts.

Chunked prefill (``tandem/rpc/prefill_chunks.py``, the same policy as the
target's): a Propose whose unread prompt is longer than a chunk (a larger one
while no other sequence is held here) feeds one chunk, answers ``Unfinished``
and is queued again by the batcher; its next check finds the chunk in the KV
(the longest common prefix) and goes on from there, so the call itself carries
no progress.

A batch first checks every call and admits it to the KV pool (counting the
blocks its whole k-step run will hold) without changing anything; a refused
call leaves its sequence exactly as it was. Releases apply in queue order
relative to a Propose of the same sequence (see ``tandem.rpc.calls``). A
sequence belongs to the owner (coordinator) whose Propose created it: another
owner's Propose is refused, even one that starts over (committed_len 0), which
its own owner may send at any time (it resends everything after a failed call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.block_pool import prefix_limit
from tandem.engine import ForwardItem, ModelEngine
from tandem.errors import (
    InvalidRequestError,
    StaleSequenceError,
    UnknownSequenceError,
    check_token_ids,
)
from tandem.models.quantize import Int8Linear
from tandem.penalties import adjust_logits
from tandem.rpc import distributions
from tandem.rpc.batcher import Unfinished
from tandem.rpc.calls import ReleaseCall
from tandem.rpc.prefill_chunks import PrefillChunks
from tandem.rpc.sequence_engine import Run, SequenceEngine, history_runs
from tandem.sampling import SamplingParams, draw_coupled, probabilities, sample
from tandem.spec.adaptive import MAX_K
from tandem.spec.proposers import common_prefix_len
from tandem.v1 import common_pb2

__all__ = ["ProposeCall", "ReleaseCall", "DraftReply", "DraftEngine", "DraftSequence", "early_exit_engine",
           "MAX_PROPOSE", "MAX_ALTERNATIVES", "DRAFT_SEED_OFFSET"]

# The draft's sampling stream must be independent of the target's (same seed otherwise).
DRAFT_SEED_OFFSET = 0x5EED
# k drafts, plus the pipelining guesses: of the first token (during prefill) and of the bonus token.
MAX_PROPOSE = MAX_K + 2
MAX_ALTERNATIVES = 8  # next-best tokens per drafted position, for speculation trees


@dataclass(slots=True)
class ProposeCall:
    seq_id: str
    committed_len: int
    new_tokens: list[int]
    k: int
    sampling: SamplingParams
    alternatives: int = 0  # next-best tokens to report per drafted position (speculation trees)
    prompt_len: int = 0  # the sequence's first prompt_len tokens are its prompt (0: not said, all fed as one run)
    owner: str = ""  # the calling coordinator's instance id (tandem.rpc.leases); it must be the sequence's owner
    verified_len: int = 0  # its first verified_len tokens are the target's committed text (0: not said)
    stop_below: float = 0.0  # draft no further once the drafted tokens' joint draft probability is below this


@dataclass(slots=True)
class DraftReply:
    tokens: list[int]
    probs: list[common_pb2.SparseDistribution]  # one per token when sampling; empty when greedy
    alternatives: list[list[int]] = field(default_factory=list)  # per token when asked: next-best, best first


@dataclass(slots=True)
class DraftSequence:
    tokens: list[int]  # what the draft holds; its KV cache holds a prefix of these
    generator: torch.Generator | None = None  # made on the sequence's first sampled Propose


@dataclass(slots=True)
class _Plan:
    """A checked Propose: what it will do, computed without changing anything."""

    index: int
    call: ProposeCall
    tokens: list[int]  # the sequence's tokens after keep + new_tokens
    keep: int  # KV prefix still valid for ``tokens``
    kv_len: int  # KV length after drafting
    drafted: list[int] = field(default_factory=list)
    probs: list[common_pb2.SparseDistribution] = field(default_factory=list)
    alternatives: list[list[int]] = field(default_factory=list)
    sure: float = 1.0  # the product of the draft's top probabilities at the positions drafted so far


def early_exit_engine(target: ModelEngine, num_layers: int, *, num_blocks: int | None = None) -> ModelEngine:
    """Self-drafting: an engine over the target's first ``num_layers`` layers, its final norm and lm_head.

    Shares the target's weights (no extra memory for them) but has a KV pool of
    its own for those layers (as many blocks as the target's unless told), so
    drafting never disturbs the target's cache. ``DraftEngine(early_exit_engine(t, n))``
    drafts in process.
    """
    total = target.config.num_layers
    if not 0 < num_layers < total:
        raise ValueError(f"early-exit layers must be in 1..{total - 1} for this model, got {num_layers}")
    return ModelEngine.with_new_cache(
        target.model,
        num_blocks or target.kv_cache.num_blocks,
        target.kv_cache.block_size,
        target.backend.name,
        num_layers=num_layers,
    )


class DraftEngine(SequenceEngine[DraftSequence, "_Plan"]):
    """Per-sequence draft state plus batched drafting through one ``ModelEngine``."""

    engine: ModelEngine

    def __init__(self, engine: ModelEngine, leases=None, prefill_chunk_tokens: int | None = 0,
                 cache_generated: bool = True, reserve_growth: bool = False) -> None:
        super().__init__(engine, leases, reserve_growth)
        # None: chunks sized from the measured step cost; 0: prompts always fed whole.
        self.chunks = PrefillChunks(prefill_chunk_tokens, engine.cost_fit, engine.prompt_cost)
        # Verified generated tokens' blocks go to the prefix cache where a generated token's KV is what a prompt
        # holding it computes (rows fixed by position), and on an int8 draft, whose rows depend on the run's
        # length anyway (long runs dequantize: tandem/models/quantize.py), so that its prompt blocks are no more
        # exact than those. Not on a dense unpacked draft: one of the target's own model must compute what
        # the target does, and the target recomputes those tokens as prompt rows. Nor with --no-cache-generated.
        self._caches_generated = cache_generated and (engine.rows_fixed_by_position or any(
            isinstance(m, Int8Linear) for m in engine.model.modules()))

    @property
    def caches_generated(self) -> bool:
        return self._caches_generated

    def call_cost(self, call: ProposeCall | ReleaseCall) -> int:
        if not isinstance(call, ProposeCall):
            return 0
        new = min(len(call.new_tokens), self.chunks.size()) if self.chunks.enabled else len(call.new_tokens)
        return new + call.k

    # ----- one batch -----------------------------------------------------
    def run_batch(self, calls: list[ProposeCall | ReleaseCall]) -> list[DraftReply | bool | BaseException]:
        results: list[DraftReply | bool | BaseException | None] = [None] * len(calls)
        admitted, late = self._plan_batch(calls, results)  # releases, checks, KV admission

        for plan in admitted:
            self._apply(plan)
        drafting = [p for p in admitted if p.call.k > 0]
        try:
            for plan in self._feed_chunks(drafting):
                results[plan.index] = Unfinished()
                drafting.remove(plan)
            self._draft(drafting)
        except Exception as exc:  # noqa: BLE001 - a failed step fails the calls still drafting
            for plan in drafting:
                if len(plan.drafted) < plan.call.k:
                    results[plan.index] = exc
        for plan in drafting:
            if results[plan.index] is None:
                self._offer_committed(plan)
        for plan in admitted:
            if results[plan.index] is None:
                results[plan.index] = DraftReply(plan.drafted, plan.probs, plan.alternatives)

        self._release_late(calls, late, results)
        return results  # type: ignore[return-value]

    def _check(self, index: int, call: ProposeCall) -> _Plan:
        if not call.seq_id:
            raise InvalidRequestError("seq_id is empty")
        if not 0 <= call.k <= MAX_PROPOSE:
            raise InvalidRequestError(f"k must be in 0..{MAX_PROPOSE}, got {call.k}")
        if not 0 <= call.alternatives <= MAX_ALTERNATIVES:
            raise InvalidRequestError(f"alternatives must be in 0..{MAX_ALTERNATIVES}, got {call.alternatives}")
        if call.committed_len < 0:
            raise InvalidRequestError(f"committed_len must be >= 0, got {call.committed_len}")
        if call.prompt_len < 0:
            raise InvalidRequestError(f"prompt_len must be >= 0, got {call.prompt_len}")
        if not 0.0 <= call.stop_below <= 1.0:  # (NaN fails this too)
            raise InvalidRequestError(f"stop_below must be in [0, 1], got {call.stop_below}")
        check_token_ids("new_tokens", call.new_tokens, self.vocab_size)
        seq = self.sequences.get(call.seq_id)
        if seq is None and call.committed_len:
            raise UnknownSequenceError(f"draft holds no sequence {call.seq_id!r}")
        held = [] if seq is None else seq.tokens
        if call.committed_len > len(held):
            raise StaleSequenceError(
                f"sequence {call.seq_id!r}: committed_len {call.committed_len} > the {len(held)} tokens held"
            )
        tokens = [*held[: call.committed_len], *call.new_tokens]
        if not tokens:
            raise InvalidRequestError(f"sequence {call.seq_id!r} has no tokens to draft from")
        if len(tokens) > self.max_context:
            raise InvalidRequestError(
                f"sequence {call.seq_id!r}: {len(tokens)} tokens exceed the context of {self.max_context}"
            )
        if call.prompt_len > len(tokens):
            raise InvalidRequestError(
                f"sequence {call.seq_id!r}: prompt_len {call.prompt_len} exceeds its {len(tokens)} tokens")
        if not 0 <= call.verified_len <= len(tokens):
            raise InvalidRequestError(
                f"sequence {call.seq_id!r}: verified_len {call.verified_len} outside 0..{len(tokens)} (its tokens)")
        cached = held[: self.engine.seq_len(call.seq_id)]
        keep = common_prefix_len(cached, tokens)
        if call.k == 0:
            return _Plan(index, call, tokens, keep, kv_len=keep)
        # Feed at least the last token: its logits are where drafting starts.
        keep = min(keep, len(tokens) - 1)
        return _Plan(index, call, tokens, keep, kv_len=len(tokens) + call.k - 1)

    def _apply(self, plan: _Plan) -> None:
        """Record the admitted call's tokens and roll its KV back to the prefix still valid."""
        call = plan.call
        seq = self.sequences.get(call.seq_id)
        if seq is None:
            seq = self.sequences[call.seq_id] = DraftSequence([])
        seq.tokens = plan.tokens
        if self.engine.seq_len(call.seq_id) > plan.keep:
            self.engine.rollback(call.seq_id, plan.keep)
        elif call.k and not self.engine.kv_cache.has_sequence(call.seq_id):
            # A new sequence starts on the cached blocks its prompt begins with; its last token is fed.
            plan.keep = self.engine.reuse_prefix(call.seq_id, plan.tokens,
                                                 limit=prefix_limit(call.prompt_len or len(plan.tokens)))
        if not call.sampling.is_greedy and seq.generator is None:
            seed = None if call.sampling.seed is None else call.sampling.seed + DRAFT_SEED_OFFSET
            # On the host, whatever the engine's device: it draws from the decoded wire rows (``_sample_step``).
            seq.generator = SamplingParams(1.0, seed=seed).make_generator("cpu")
        if seq.generator is not None:  # seeded: the draws of the positions drafted next, on any replica
            call.sampling.seed_at(seq.generator, len(plan.tokens), stream=DRAFT_SEED_OFFSET)

    def _offer_committed(self, plan: _Plan) -> None:
        """The full blocks of what the call says is committed go to the prefix cache: its prompt, and (see
        ``caches_generated``) its first ``verified_len`` tokens, the target's own text. Later tokens may be
        pipelined guesses or this draft's own drafts: never offered."""
        call = plan.call
        committed = max(call.prompt_len, call.verified_len if self._caches_generated else 0)
        if committed:
            self.engine.commit(call.seq_id, plan.tokens, committed)

    def _feed_chunks(self, plans: list[_Plan]) -> list[_Plan]:
        """Feed one chunk of each long unread prompt (larger ones while no other sequence is held here, so that a
        newcomer soon joins the batch); those plans."""
        if not self.chunks.enabled:
            return []
        unread = {p.index: (p.call.prompt_len or len(p.tokens)) - p.keep for p in plans}
        # As the target's (TargetEngine._chunk): the prompts share a lone chunk while every sequence held here is a
        # prompt being read, and take running-size chunks otherwise.
        reading = [p for p in plans if unread[p.index] > 0]
        spans = [(unread[p.index], p.keep) for p in reading]
        lone = set(self.sequences) <= {p.call.seq_id for p in reading}
        cuts = self.chunks.take_lone(spans) if lone else [self.chunks.take(*span) for span in spans]
        long = [p for p, now, (left, _) in zip(reading, cuts, spans) if now < left]
        now = {p.index: cut for p, cut in zip(reading, cuts)}
        if not long:
            return []
        self.engine.forward([ForwardItem(p.call.seq_id, p.tokens[p.keep:p.keep + now[p.index]], num_logits=0,
                                         prompt=True) for p in long])
        for plan in long:  # the prompt's full blocks so far may serve other prompts already
            self._offer_committed(plan)
        return long

    def _draft(self, plans: list[_Plan]) -> None:
        """k decode steps (fewer where ``stop_below`` stops a sequence), every sequence still drafting in each
        step's one forward pass.

        What a sequence has not read goes first, as the target read it (``history_runs``): the
        runs before its last are fed without logits, one forward pass per run for the sequences
        that have one; the last run is the first step's input."""
        runs = {p.index: history_runs(p.tokens, p.keep, p.call.prompt_len) for p in plans}
        for step in range(max((len(r) - 1 for r in runs.values()), default=0)):
            self.engine.forward([ForwardItem(p.call.seq_id, runs[p.index][step].tokens, num_logits=0,
                                             prompt=runs[p.index][step].prompt)
                                 for p in plans if step < len(runs[p.index]) - 1])
        feed = {p.index: runs[p.index][-1] for p in plans}
        # Penalties: where each sequence's generated text starts (prompt_len 0, not said: all it holds now is
        # taken as prompt), and its prompt's distinct ids.
        prompts: dict[int, tuple[int, frozenset[int]]] = {}
        for p in plans:
            if p.call.sampling.adjusts_logits:
                start = p.call.prompt_len or len(p.tokens)
                prompts[p.index] = start, frozenset(p.tokens[:start])
        active = list(plans)
        while active:
            logits = self.engine.forward([ForwardItem(p.call.seq_id, feed[p.index].tokens, num_logits=1,
                                                      prompt=feed[p.index].prompt) for p in active])
            for plan in active:  # the fed tokens are in the cache now
                if plan.drafted:
                    self.sequences[plan.call.seq_id].tokens.append(plan.drafted[-1])
            rows = dict(zip((p.index for p in active), logits))  # each [1, vocab]
            self._adjust([p for p in active if p.index in prompts], rows, prompts)
            greedy = [p for p in active if p.call.sampling.is_greedy]
            if greedy:
                picks = torch.cat([rows[p.index] for p in greedy]).argmax(-1).tolist()
                for plan, token in zip(greedy, picks):
                    plan.drafted.append(token)
            self._sample_step([p for p in active if not p.call.sampling.is_greedy], rows)
            self._alternatives([p for p in active if p.call.alternatives], rows)
            self._note_sureness([p for p in active if p.call.stop_below > 0 and len(p.drafted) < p.call.k], rows)
            active = [p for p in active if len(p.drafted) < p.call.k and p.sure >= p.call.stop_below]
            feed = {p.index: Run([p.drafted[-1]], False) for p in active}

    def _adjust(self, plans: list[_Plan], rows: dict[int, torch.Tensor],
                prompts: dict[int, tuple[int, frozenset[int]]]) -> None:
        """Each plan's row with its request's penalties and bias, for the context it holds now (the drafts
        so far included), as the target will judge that position (``tandem.penalties``): a draft that
        ignored them would propose what the target's adjusted rows turn down. Proposals only: what the
        target keeps does not depend on it."""
        for plan in plans:
            start, prompt = prompts[plan.index]
            rows[plan.index] = adjust_logits(rows[plan.index], plan.call.sampling, prompt, plan.tokens[start:], [[]])

    def _note_sureness(self, plans: list[_Plan], rows: dict[int, torch.Tensor]) -> None:
        """Each plan's ``sure`` times the draft's top probability at the position just drafted (its logits'
        softmax, whatever the request samples with: a measure of how sure the draft is, which ``stop_below``
        compares). Which tokens are drafted does not depend on it, only how many: the target's acceptance
        rule judges each drafted token alone, so stopping early is lossless."""
        if not plans:
            return
        top = torch.softmax(torch.cat([rows[p.index] for p in plans]).float(), dim=-1).amax(dim=-1)  # [P]
        for plan, probability in zip(plans, top.tolist()):  # one device-to-host copy for the batch
            plan.sure *= probability

    def _alternatives(self, plans: list[_Plan], rows: dict[int, torch.Tensor]) -> None:
        """Each plan's next-best tokens at the position just drafted, other than the drafted one.

        They become deterministic leaves of a speculation tree; excluding the drafted token
        (even a sampled one) keeps the tree rule lossless (see ``tandem.spec.tree``).
        """
        if not plans:
            return
        width = max(p.call.alternatives for p in plans) + 1
        top = torch.cat([rows[p.index] for p in plans]).topk(width, dim=-1).indices.tolist()  # [P, width]
        for plan, best in zip(plans, top):
            drafted = plan.drafted[-1]
            plan.alternatives.append([t for t in best if t != drafted][: plan.call.alternatives])

    def _sample_step(self, plans: list[_Plan], rows: dict[int, torch.Tensor]) -> None:
        """One sampled token per plan: q for all of them encoded once, each token drawn from decode(messages)."""
        if not plans:
            return
        groups: dict[tuple, list[_Plan]] = {}  # rows with the same processing share one probabilities() call
        for plan in plans:
            s = plan.call.sampling
            groups.setdefault((s.temperature, s.min_p, s.top_p, s.top_k), []).append(plan)
        order = [p for group in groups.values() for p in group]
        q = torch.cat([
            probabilities(torch.cat([rows[p.index] for p in group]), group[0].call.sampling)
            for group in groups.values()
        ])  # [R, vocab], on the model's device
        wire = distributions.encode_for_sampling(q)  # one device-to-host copy for all R rows
        for r, plan in enumerate(order):
            if plan.call.sampling.exact_seed:
                # Seeded: the target keeps a token when it is the target's own seeded draw at its position
                # (tandem.spec.rejection, "Seeded sampling"), so draw it from that draw's very noise.
                # ``plan.tokens`` has grown by the tokens drafted so far: its length is this token's position.
                # The noise is a hash of (seed, position, token id): the target's on any device, here for the
                # support's ids alone.
                ids = torch.from_numpy(wire.token_ids[r])  # [N_r]
                index = draw_coupled(wire.probs[r], ids, plan.call.sampling.noise_key(len(plan.tokens)))
            else:
                # Draw from decode(message) itself, over its support (the rest of the row is 0).
                index = int(sample(wire.probs[r][None], self.sequences[plan.call.seq_id].generator)[0])
            plan.drafted.append(int(wire.token_ids[r][index]))
            plan.probs.append(wire.messages[r])

    def warmup(self) -> None:
        """The engine's own warm-up, then greedy and sampled Propose and a Release once."""
        self.engine.warmup()
        seq = "__warmup__"
        calls = [ProposeCall(seq, 0, [1, 2, 3, 4], 4, SamplingParams()),
                 ProposeCall(seq, 4, [], 2, SamplingParams(temperature=1.0, seed=0)),
                 ReleaseCall(seq)]
        for call in calls:
            (result,) = self.run_batch([call])
            if isinstance(result, BaseException):
                raise result
