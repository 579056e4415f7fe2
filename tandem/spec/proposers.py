"""Where a round's draft tokens come from: n-gram lookup in the coordinator, or a draft model over a channel.

``DraftProposer`` is the only place that remembers what the draft side holds
for a sequence (the tokens already sent to it), so each Propose sends just
``committed_len`` and the tokens the draft has not seen. The draft side keeps
its own KV for those tokens and rolls it back to ``committed_len`` by itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.block_pool import prefix_limit
from tandem.sampling_params import SamplingParams
from tandem.spec.ngram import NgramIndex, lookup_match
from tandem.spec.transport import DraftChannel, Drafted
from tandem.spec.tree import TokenTree

NGRAM = "ngram"  # the request's own text (prompt lookup)
CACHE = "cache"  # the continuation cache: what every request generated (tandem.spec.shared_cache)
DRAFT = "draft"
HEADS = "heads"  # the target's own speculation heads (medusa, eagle): a tree from the last Verify's reply
GRAMMAR = "grammar"  # the tokens a request's grammar forces next, from the last Prefill's or Verify's reply
PREDICTION = "prediction"  # the client's prediction of the answer (tandem.spec.prediction)
LOOKUP_SOURCES = (NGRAM, CACHE, PREDICTION)  # proposals found by lookup: k chosen after it, by the kind of match


@dataclass(slots=True)
class Proposal:
    """Draft tokens valid for a history of ``base_len`` tokens."""

    base_len: int  # the history length these drafts continue
    tokens: list[int]
    probs: Sequence[Any] = ()  # one q per token, as the draft sampled from it; empty: deterministic
    guess: int | None = None  # the draft's guess of the token after all drafts (pipelining)
    source: str = NGRAM
    alternatives: Sequence[Sequence[int]] = ()  # per token, the draft's next-best tokens (trees), when asked
    tree: TokenTree | None = None  # this round's token tree, whose first branch is tokens[:k]; None: a chain
    match_len: int = 0  # n-gram sources: the length of the context that matched (the evidence's strength)


class ContinuationCache(Protocol):
    """What the loop needs of ``tandem.spec.shared_cache.SharedContinuations``."""

    async def lookup(self, context: Sequence[int], k: int) -> Any:
        """A ``CacheHit`` (tokens, match_len, count, source) or None."""

    def learn(self, tokens: Sequence[int], start: int = 0, *, final: bool = False) -> None: ...


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def ngram_proposal(history: list[int], k: int, min_n: int, max_n: int,
                   index: NgramIndex | None = None) -> tuple[Proposal, int]:
    """The continuation of the longest earlier match of the history's suffix, and the match length.

    ``index``: the request's ``NgramIndex`` over ``history`` (a loop's rounds: no rescan); None scans.
    """
    lookup = index.lookup_match if index is not None else lookup_match
    tokens, matched = lookup(history, k, min_n, max_n)
    return Proposal(len(history), tokens, source=NGRAM, match_len=matched), matched


class DraftProposer:
    """One request's view of its draft replica."""

    def __init__(self, channel: DraftChannel, seq_id: str, sampling: SamplingParams, prompt_len: int) -> None:
        self.channel = channel
        self.seq_id = seq_id
        self.sampling = sampling
        self.prompt_len = prompt_len  # the draft reads the prompt as the target's Prefill did
        self.sent: list[int] = []  # what the draft holds as this sequence's history
        self.opened = False  # whether the draft may hold this sequence (then it must be released)

    def lag(self, history: list[int]) -> int:
        """Committed tokens the draft has not seen (it must read them before it can draft)."""
        return len(history) - common_prefix_len(self.sent, history)

    def unread(self, history: list[int]) -> int:
        """Of those, the ones the draft must compute: a sequence new there starts on the prompt blocks its
        prefix cache holds (at most all but the prompt's last token: ``prefix_limit``), as far as the
        channel can tell (``DraftChannel.cached_prefix``, a hint)."""
        behind = self.lag(history)
        if self.sent or behind == 0:
            return behind  # the draft holds the sequence: it goes on from there, not from its cache
        return behind - self.channel.cached_prefix(history[:prefix_limit(self.prompt_len)])

    async def propose(self, tokens: list[int], k: int, alternatives: int = 0, verified_len: int = 0,
                      stop_below: float = 0.0) -> Drafted:
        """Draft ``k`` tokens after ``tokens`` (fewer where the draft is unsure: ``stop_below``), sending only what
        the draft does not hold yet; the first ``verified_len`` of ``tokens`` are the target's committed text (the
        rest may be guesses)."""
        keep = common_prefix_len(self.sent, tokens)
        new_tokens = list(tokens[keep:])
        # Record what the draft will hold before awaiting: a later call is computed against it.
        self.sent = list(tokens)
        self.opened = True
        try:
            drafted = await self.channel.propose(self.seq_id, keep, new_tokens, k, self.sampling, alternatives,
                                                 self.prompt_len, verified_len, stop_below)
        except BaseException:
            self.sent = []  # unknown state on the draft side: the next call resends everything
            raise
        if drafted.lost:
            self.sent = []  # (a failover channel gave up on the call: as unknown)
        return drafted

    async def release(self) -> None:
        if self.opened:
            self.sent, self.opened = [], False
            await self.channel.release(self.seq_id)
