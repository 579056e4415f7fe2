"""The two small interfaces the speculation loop runs against: a verifier and a draft channel.

Each has two implementations: in-process engines behind a batcher
(``tandem.inprocess``) and gRPC worker clients (``coordinator.workers``). The
loop never knows which it talks to. Draft distributions (``probs``) are
opaque here: the draft produces them in the wire format, the verifier
consumes that very object, and nothing between the two decodes or re-encodes
it (the acceptance test must see exactly the q the draft sampled from).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.sampling_params import SamplingParams


@dataclass(slots=True)
class Drafted:
    """What a draft channel proposed: tokens, their q when sampled, and next-best tokens when asked."""

    tokens: list[int]
    probs: Sequence[Any] = ()  # one q per token (opaque wire messages), or empty: deterministic
    alternatives: Sequence[Sequence[int]] = ()  # per token when asked: the draft's next-best, best first
    # A failover channel (``tandem.spec.failover``) that gave up on the call rather than fail it says so:
    lost: bool = False  # what the draft side holds of the sequence is unknown: the next call sends all of it
    gone: bool = False  # no draft replica is left: the request goes on without one


@dataclass(slots=True)
class TreeProposal:
    """The target's heads' proposal for the next round: a token tree rooted after its next token."""

    tokens: list[int]
    parents: list[int]  # per token, its parent's index among tokens (-1: the root), parents first


@dataclass(slots=True)
class TokenLogprob:
    """The target's log-probability of one emitted token, and of its most likely tokens there (when asked)."""

    logprob: float
    top_ids: list[int] = field(default_factory=list)  # most likely first
    top_logprobs: list[float] = field(default_factory=list)
    rank: int = 0  # a prompt token's score: 1 + how many tokens are more likely there; 0: not ranked (emitted)


@dataclass(slots=True)
class Prefilled:
    next_token: int  # the target's first token (a rebuild: the history's last, echoed)
    proposal: TreeProposal | None = None  # asked with ``propose``: the first round's drafts
    reused_tokens: int = 0  # prompt tokens the target took from its prefix cache
    logprobs: list[TokenLogprob] | None = None  # asked with ``sampling.logprobs``: next_token's
    forced: Sequence[int] = ()  # a constrained request: the tokens its grammar forces after next_token
    prompt_logprobs: list[TokenLogprob] | None = None  # asked with ``sampling.prompt_logprobs``: prompt tokens 1..


@dataclass(slots=True)
class Verified:
    kept: list[int]  # the kept drafts' indices, root to leaf
    next_token: int  # the target's own token after them
    proposal: TreeProposal | None = None  # asked with ``propose``: the next round's drafts, after next_token
    logprobs: list[TokenLogprob] | None = None  # asked with ``sampling.logprobs``: the kept drafts', next_token's
    forced: Sequence[int] = ()  # a constrained request: the tokens its grammar forces after next_token


@dataclass(slots=True, frozen=True)
class FittedCost:
    """Seconds of one forward pass ~ ``base_s + per_token_s * tokens``, as the worker measured it."""

    base_s: float
    per_token_s: float  # 0 while recent batch sizes are too alike to tell (tandem.cost_fit)
    # The line at the last slope the worker could estimate (0: not known yet). The heads' node budget
    # prices nodes with it: a heads loop verifies one tree size round after round, so ``per_token_s`` soon
    # reads 0 there.
    last_base_s: float = 0.0
    last_per_token_s: float = 0.0
    # What a prompt token adds to a pass (a prefill's price per token; 0: not measured yet). A draft
    # that must first read a long prompt pays about this per token (``SpeculationLoop._draft_waits``).
    prompt_token_s: float = 0.0
    # What the worker computes on (``tandem.device_key``; "": not said) and how many calls its recent batch steps
    # held (0: none ran yet): a draft sharing the target's device, its streams out of step, costs the target the
    # draft steps of every stream (``tandem.spec.adaptive.LoadAwareCost``).
    device_key: str = ""
    calls_per_batch: float = 0.0


class Verifier(Protocol):
    """The target side: prefill a prompt, verify drafts, forget a sequence."""

    async def prefill(self, seq_id: str, token_ids: list[int], sampling: SamplingParams, prompt_len: int = 0,
                      propose: int = 0, wait_for_room_s: float = 0.0) -> Prefilled:
        """Ingest the prompt; the target's first token. ``prompt_len`` > 0: rebuild a moved request
        from its whole committed history (the first ``prompt_len`` tokens its prompt); echoes the last.
        ``propose`` > 0: the request drafts with the target's heads; their first proposal, of at most
        that many nodes, comes with the reply. ``wait_for_room_s`` > 0: a full KV pool holds the call up to
        that long for room before refusing it (a target worker; in process nothing is refused for room)."""

    async def verify(self, seq_id: str, committed_len: int, draft_tokens: list[int],
                     draft_probs: Sequence[Any], draft_parents: Sequence[int] = (), propose: int = 0) -> Verified:
        """Keep ``committed_len`` tokens, score the last one plus the drafts (a chain, or a token tree
        given ``draft_parents``): the kept drafts and the target's next token; with ``propose`` > 0 (a
        heads request), the heads' proposal for the next round too."""

    async def release(self, seq_id: str) -> None:
        """Best effort: free the sequence's KV."""

    def fitted_cost(self) -> FittedCost | None: ...

    @property
    def streams(self) -> int:
        """Sequences sharing this target now (adaptive k plans for the load)."""


class DraftChannel(Protocol):
    """The draft side: Propose(seq, committed_len, new_tokens, k) as the draft worker defines it."""

    async def propose(self, seq_id: str, committed_len: int, new_tokens: list[int], k: int,
                      sampling: SamplingParams, alternatives: int = 0, prompt_len: int = 0,
                      verified_len: int = 0, stop_below: float = 0.0) -> Drafted:
        """Keep ``committed_len`` tokens, append ``new_tokens``, draft k (and ``alternatives``
        next-best tokens per position); the sequence's first ``prompt_len`` tokens are its prompt, its first
        ``verified_len`` the target's committed text (prompt included), which the draft may cache; ``stop_below``:
        draft no further once the draft's top probabilities so far multiply to less (ProposeRequest.stop_below)."""

    async def release(self, seq_id: str) -> None: ...

    def fitted_cost(self) -> FittedCost | None: ...

    def cached_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` (a prompt) the draft's prefix cache holds, as far as this
        side can tell without a call (a hint for pricing a read, never for correctness; 0: none known)."""

    def sequence_room(self) -> int | None:
        """The most tokens one sequence may reach on the draft (its whole KV pool, less a round in flight): a
        sequence past it is refused as full on every call, however empty the pool; None: not known."""


class ReplicaSource(Protocol):
    """Where a request finds another replica when one fails it (the coordinator's pools).

    In process there is none: a failure there reaches the caller. Each method returns
    None when no replica is left or the request has moved as often as it may.
    """

    async def replace_target(self, faulty: bool) -> Verifier | None:
        """The target this request runs on from now on. ``faulty``: the current replica failed the
        request (it is skipped); otherwise it only refused for capacity and may be chosen again."""

    async def replace_draft(self) -> DraftChannel | None:
        """The draft this request drafts with from now on."""
