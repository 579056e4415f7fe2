"""Which proposer a request uses and how hard it speculates: the one place methods are named and resolved.

Methods:
- ``none``: target only (plain decoding through the same loop, k = 0);
- ``ngram``: prompt lookup over the request's own text (no draft model needed);
- ``draft``: the draft model;
- ``hybrid``: n-gram lookup when the text repeats a run of ``hybrid_min_match``+
  tokens, the draft model otherwise;
- ``early-exit``: the target's own first layers as the draft. In process
  only: it shares the target's weights, so over gRPC it would be a second
  model inside the target worker rather than a draft fleet of its own;
- ``medusa``, ``eagle``: the target's own speculation heads (``--heads``,
  tandem/heads) propose a token tree with each verification's reply: one RPC
  a round, no draft model;
- ``auto``: the target's heads when it has them, else ``hybrid`` when a draft
  model is configured (spec_bench: 1.91x target-only against 1.73x for
  ``draft``), else ``ngram``. With heads and a draft model both there, a
  request starts with its heads and runs ``hybrid`` rounds instead while the
  heads measure slower (``heads_fallback``, ``tandem.spec.heads_payoff``): a
  draft fleet is not left idle beside heads that do not pay.

Any of them may verify a token tree instead of a chain (``tree``, ``tree_width``;
``tandem.spec.tree``): the draft's next-best tokens and other n-gram continuations
become branches beside the chain.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import InvalidRequestError
from tandem.spec.adaptive import MAX_K

# Speculation trees: ``auto`` builds one when the cost model says its extra candidates pay for their
# rows in the verification; ``on`` whenever there are candidates to add (tests, benchmarks); ``off``: chains.
TREE_MODES = ("auto", "on", "off")
MAX_TREE_WIDTH = 4  # other candidates per position at most

METHODS = ("auto", "none", "draft", "ngram", "hybrid", "early-exit", "medusa", "eagle")
REMOTE_METHODS = ("auto", "none", "draft", "ngram", "hybrid", "medusa", "eagle")  # offered over gRPC
DRAFT_METHODS = ("draft", "hybrid", "early-exit")  # need a draft model (early-exit: the target's layers)
HEADS_METHODS = ("medusa", "eagle")  # need the target's heads of that kind


def check_tree_mode(mode: str) -> str:
    """``mode`` if it is one of TREE_MODES; else InvalidRequestError naming the choices."""
    if mode not in TREE_MODES:
        raise InvalidRequestError(f"unknown tree mode {mode!r}; choose one of {', '.join(TREE_MODES)}")
    return mode


HEADS_FALLBACKS = ("plain", "hybrid")  # what a heads request's rounds do while its heads do not pay


def heads_fallback(requested: str, resolved: str, has_draft: bool) -> str:
    """``hybrid`` where ``auto`` chose the heads and a draft model is there too, else ``plain``: a request
    that names a heads method gets those heads (and plain decoding while they do not pay), nothing else."""
    return "hybrid" if requested == "auto" and resolved in HEADS_METHODS and has_draft else "plain"


def resolve_method(method: str, has_draft: bool, offered: tuple[str, ...] = METHODS, heads: str = "") -> str:
    """``auto`` -> a concrete method; refuse unknown methods and methods that need a missing draft or heads.

    ``heads``: the kind of speculation heads the target serves ("": none)."""
    if method not in offered:
        raise InvalidRequestError(f"unknown method {method!r}; choose one of {', '.join(offered)}")
    if method == "auto":
        return heads or ("hybrid" if has_draft else "ngram")
    if method in ("draft", "hybrid") and not has_draft:
        raise InvalidRequestError(f"method {method!r} needs a draft model, and none is configured")
    if method in HEADS_METHODS and method != heads:
        served = f"serves {heads} heads" if heads else "serves no heads (start it with --heads)"
        raise InvalidRequestError(f"method {method!r} needs the target's {method} heads; the target {served}")
    return method


@dataclass(slots=True, frozen=True)
class SpecOptions:
    """How one request speculates (``method`` already resolved)."""

    method: str = "ngram"
    k_max: int = 4  # most draft tokens per round; 0 disables speculation
    adaptive_k: bool = True  # False: always draft k_max (within the room left)
    pipelined: bool = False  # draft round r+1 while round r is verified
    ngram_min: int = 1
    ngram_max: int = 4
    hybrid_min_match: int = 3  # hybrid: an n-gram match this long wins over the draft model
    tree: str = "off"  # one of TREE_MODES (the CLI and the public request default to auto)
    tree_width: int = 2  # most other candidates per position in a tree
    heads_nodes: int = 0  # medusa/eagle: most nodes of the heads' tree; 0: chosen from the verification cost
    # medusa/eagle: the rounds that do not ask the heads (they measure slower) decode plainly, verifying the
    # text's own repeats, or run as ``hybrid`` rounds with the draft model (``heads_fallback``)
    heads_fallback: str = "plain"
    # A lone unpipelined request runs n-gram rounds while its draft's read of a long prompt would not pay yet
    # (``SpeculationLoop._draft_waits``); False: the draft reads it at once (spec_bench's ``*-eager`` methods)
    draft_waits: bool = True
    # A constrained request proposes what its grammar forces next (``SpeculationLoop._forced``); False: only to
    # measure what that adds (tool_calls.py's ``*-unforced`` methods)
    forced_proposals: bool = True
    # An adaptive request's draft model stops drafting where it is unsure (``tandem.spec.adaptive.stop_below``);
    # False: it drafts all of the k chosen (spec_bench's ``*-full`` methods)
    draft_stops: bool = True
    # Rounds proposed by lookup (the request's own text, the continuation cache, the client's prediction) verify
    # up to this many of the tokens found, as many as their kind of match earns (``MatchRates``; adaptive requests),
    # whatever k the draft model drafts: text the answer copies is verified a long run at a time, where k (4 by
    # default) is sized for a draft model's steps. The coordinator sets the request's own k here when it gives one.
    lookup_k_max: int = MAX_K

    def __post_init__(self) -> None:
        if self.method not in METHODS or self.method == "auto":
            raise InvalidRequestError(f"speculation method must be resolved, got {self.method!r}")
        if not 0 <= self.k_max <= MAX_K:
            raise InvalidRequestError(f"k (draft tokens per round) must be in 0..{MAX_K}, got {self.k_max}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidRequestError(f"n-gram sizes need 1 <= min <= max, got {self.ngram_min}..{self.ngram_max}")
        if not 1 <= self.hybrid_min_match:
            raise InvalidRequestError(f"hybrid min match must be >= 1, got {self.hybrid_min_match}")
        check_tree_mode(self.tree)
        if not 0 <= self.lookup_k_max <= MAX_K:
            raise InvalidRequestError(f"lookup k must be in 0..{MAX_K}, got {self.lookup_k_max}")
        if not 1 <= self.tree_width <= MAX_TREE_WIDTH:
            raise InvalidRequestError(f"tree width must be in 1..{MAX_TREE_WIDTH}, got {self.tree_width}")
        if not 0 <= self.heads_nodes <= MAX_K:
            raise InvalidRequestError(f"heads nodes must be in 0..{MAX_K} (0: chosen by cost), got {self.heads_nodes}")
        if self.heads_fallback not in HEADS_FALLBACKS:
            raise InvalidRequestError(f"heads fallback must be one of {', '.join(HEADS_FALLBACKS)}, "
                                      f"got {self.heads_fallback!r}")
        if self.heads_fallback != "plain" and self.method not in HEADS_METHODS:
            raise InvalidRequestError(f"heads fallback {self.heads_fallback!r} is for heads methods, "
                                      f"not {self.method!r}")

    @property
    def draft_between_heads(self) -> bool:
        """Heads rounds while the heads pay, ``hybrid`` rounds with the draft model while they do not (an
        adaptive request: one with a fixed k asks its heads every round)."""
        return self.heads_fallback == "hybrid" and self.uses_heads and self.adaptive_k

    @property
    def uses_draft(self) -> bool:
        return (self.method in DRAFT_METHODS and self.k_max > 0) or self.draft_between_heads

    @property
    def uses_heads(self) -> bool:
        return self.method in HEADS_METHODS and self.k_max > 0

    @property
    def uses_ngram(self) -> bool:
        return (self.method in ("ngram", "hybrid") and self.k_max > 0) or self.draft_between_heads
