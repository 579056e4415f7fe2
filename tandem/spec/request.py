"""One request's state in the speculation loop: its token history, stop conditions and statistics.

The history (prompt + every committed token) is the one authoritative copy:
it is what lets any worker's state be rebuilt elsewhere. Tokens are committed
one by one so that stop token ids, stop strings and max_new_tokens all cut
exactly where they occur, even in the middle of a run of accepted drafts.

Plain data, no torch: the coordinator and the in-process generator share it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import InternalError, InvalidRequestError
from tandem.sampling_params import SamplingParams
from tandem.spec.adaptive import AcceptanceTracker


@dataclass(slots=True, frozen=True)
class StopConditions:
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise InvalidRequestError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise InvalidRequestError("stop strings must not be empty")


@dataclass(slots=True)
class GenerationStats:
    """What one request's rounds did; ``as_dict`` is what the CLI and the benchmarks print."""

    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0  # of which the target kept
    rejected: int = 0  # speculative rounds whose chain (a tree: its first branch) ended at a rejected token
    rounds: int = 0  # target forwards after the prefill
    spec_rounds: int = 0  # rounds that verified at least one draft token
    ngram_rounds: int = 0  # of which proposed by n-gram lookup (own text or cache; the rest: the draft model)
    cache_rounds: int = 0  # of which from the continuation cache
    k_counts: Counter[int] = field(default_factory=Counter)  # rounds per chosen k (bounded by MAX_K + 1 keys)
    tree_rounds: int = 0  # rounds that verified a token tree rather than a chain
    tree_nodes: int = 0  # draft tokens those trees held (all counted in drafted)
    branch_tokens: int = 0  # accepted tokens off the trees' first branch: what trees added
    prompt_tokens_reused: int = 0  # prompt tokens the target took from its prefix cache at the first Prefill
    # Rounds without the draft model while reading what it lacked (a long prompt) would not have paid yet
    draft_wait_rounds: int = 0
    forced_tokens: int = 0  # tokens kept from GRAMMAR proposals: what the grammar forced
    # Tokens proposed from the client's prediction of the answer (PREDICTION) that verification kept, and that it
    # did not keep (OpenAI's accepted_prediction_tokens and rejected_prediction_tokens)
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    # Heads rounds (medusa, eagle), per depth d >= 1 of the heads' tree: rounds whose tree reached depth d,
    # and rounds that kept a token at depth d (their ratio: the acceptance of head position d).
    depth_offered: Counter[int] = field(default_factory=Counter)
    depth_kept: Counter[int] = field(default_factory=Counter)
    generated: int = 0
    started_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    # Seconds the loop waited on its workers, and the wall time of its rounds: their difference is
    # the loop's own overhead.
    draft_wait_s: float = 0.0
    verify_wait_s: float = 0.0
    round_wall_s: float = 0.0
    # Faults survived: moves to another replica (or, for the draft, going on without one) and
    # preemptions (the target's KV freed while its pool was full, then rebuilt from the history).
    target_moves: int = 0
    draft_moves: int = 0
    preemptions: int = 0
    room_waits: int = 0  # a Prefill (prompt or rebuild) refused for a full pool, which held nothing and waited
    # Seconds its target calls waited: for room in a full pool (refused or preempted) or for a healthy replica
    queue_s: float = 0.0

    @property
    def elapsed_s(self) -> float:
        """From the start (prefill included) to the last token."""
        return (self.last_token_at or self.started_at) - self.started_at

    @property
    def first_token_s(self) -> float:
        return (self.first_token_at or self.started_at) - self.started_at

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
    def mean_k(self) -> float:
        return sum(k * n for k, n in self.k_counts.items()) / self.rounds if self.rounds else 0.0

    @property
    def depth_acceptance(self) -> dict[int, float]:
        """Heads rounds: per tree depth, the share of rounds reaching it that kept a token there."""
        return {d: round(self.depth_kept[d] / n, 4) for d, n in sorted(self.depth_offered.items())}

    def as_dict(self) -> dict[str, float | int]:
        return {
            "generated": self.generated,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "elapsed_s": round(self.elapsed_s, 4),
            "first_token_s": round(self.first_token_s, 4),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "rounds": self.rounds,
            "ngram_rounds": self.ngram_rounds,
            "cache_rounds": self.cache_rounds,
            "mean_k": round(self.mean_k, 3),
            "mean_accepted_len": round(self.mean_accepted_len, 3),
            "tree_rounds": self.tree_rounds,
            "branch_tokens": self.branch_tokens,
            "prompt_tokens_reused": self.prompt_tokens_reused,
            "draft_wait_rounds": self.draft_wait_rounds,
            "forced_tokens": self.forced_tokens,
            **({"prediction_accepted": self.prediction_accepted, "prediction_rejected": self.prediction_rejected}
               if self.prediction_accepted or self.prediction_rejected else {}),
            "acceptance_rate": round(self.acceptance_rate, 4),
            **({"queue_s": round(self.queue_s, 4)} if self.queue_s else {}),
            **({"depth_acceptance": self.depth_acceptance} if self.depth_offered else {}),
        }


class RequestState:
    """A request in flight: history, stop conditions, optional text, acceptance and statistics.

    ``text`` (a ``tandem.text_stream.TextStream``) is given when the request has
    stop strings or streams text; the in-process generator works on ids alone.
    ``prediction``: the tokens the client expects the answer to repeat (``tandem.spec.prediction``).
    """

    def __init__(self, prompt_ids: list[int], sampling: SamplingParams, stop: StopConditions,
                 text: Any | None = None, prediction: Sequence[int] = ()) -> None:
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty: give at least one token")
        if stop.stop_strings and text is None:
            raise ValueError("stop strings need a TextStream to match against")
        self.prompt_ids = list(prompt_ids)
        self.history = list(prompt_ids)
        self.sampling = sampling
        self.stop = stop
        self.text = text
        self.prediction = list(prediction)
        self.tracker = AcceptanceTracker()
        self.stats = GenerationStats()
        self.finish_reason: str | None = None  # "stop" (a stop token or string) or "length"
        # Asked (``sampling.logprobs``): the target's log-probabilities, one per generated token.
        self.logprobs: list[Any] | None = [] if sampling.logprobs is not None else None
        # Asked (``sampling.prompt_logprobs``): the target's, one per prompt token after the first, from its Prefill.
        self.prompt_logprobs: list[Any] | None = None

    @property
    def generated(self) -> list[int]:
        return self.history[len(self.prompt_ids):]

    @property
    def num_generated(self) -> int:
        return len(self.history) - len(self.prompt_ids)

    @property
    def remaining(self) -> int:
        return self.stop.max_new_tokens - self.num_generated

    def commit(self, tokens: list[int], logprobs: list[Any] | None = None) -> None:
        """Append tokens one by one, stopping at a stop token, a stop string or the length limit; ``logprobs``
        (one per token, when the request asked for them) are kept for the tokens committed."""
        if self.logprobs is not None and (logprobs is None or len(logprobs) != len(tokens)):
            raise InternalError("a target worker answered no log-probabilities for tokens the request asked them of")
        now = time.perf_counter()
        for i, token in enumerate(tokens):
            if self.finish_reason:
                break
            self.history.append(token)
            if self.logprobs is not None:
                self.logprobs.append(logprobs[i])
            if self.stats.first_token_at is None:
                self.stats.first_token_at = now
            self.stats.last_token_at = now
            if token in self.stop.stop_token_ids:
                self.finish_reason = "stop"
            elif self.text is not None and self.text.push(token):
                self.finish_reason = "stop"
            elif self.remaining <= 0:
                self.finish_reason = "length"
        self.stats.generated = self.num_generated
        if self.finish_reason and self.text is not None and not self.text.stopped:
            self.text.finish()
