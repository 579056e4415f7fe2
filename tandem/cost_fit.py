"""The measured cost of a model's forward pass, fitted online: what adaptive k plans with.

An engine fits it over its own batches and workers report it in Info. It is
plain arithmetic (no torch), so the coordinator reads the same type.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class ForwardCostFit:
    """Seconds of one forward pass as a line in the tokens it carries: ``base_s + per_token_s * tokens``.

    A worker fits it online over its own batches (least squares on
    exponentially weighted sums, so it follows load and thermal drift) and
    reports it in Info. The intercept is the cost of reading the weights once,
    the slope what each extra token adds: at batch 1 the slope is small and
    speculation is nearly free; with many streams batched, every draft token
    of every stream adds ``per_token_s`` and speculation can stop paying.

    Only passes without prompt tokens (decode and verify steps), of up to
    ``max_tokens``, are fitted: the cost is not a line over all sizes. Small
    batches are bound by reading the weights (measured: 1 to 8 tokens add 2.7
    ms each to a 121 ms pass), prompt prefills by compute (several ms per
    token), and a line through both would charge every draft token a
    prefill's price and talk adaptive k out of drafting. Prompt tokens are
    priced apart (``PromptTokenCost``): a step carrying a prefill chunk beside
    decode rows fitted here would have inflated the intercept the chunk's own
    size is computed from, and chunks grew as they got dearer (measured).
    """

    decay: float = 0.98  # weight of the past per observation
    # ... and per this many seconds between observations, when they come further apart: a line fitted
    # a minute ago (a warm-up beside another worker's, before the load changed) fades on the first
    # pass after it instead of outweighing it fifty to one. Back-to-back forwards decay per
    # observation as before. Measured stale: a draft worker's warm-up fitted 102 ms a step beside
    # its target (23 ms alone), adaptive k chose 0, and only exploring rounds computed on it again.
    decay_period_s: float = 0.1
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)
    # Tokens: below this spread of recent batch sizes the slope is not trusted, and ``per_token_s`` reads 0:
    # speculation looks free, so adaptive k drafts again and the sizes vary again (a pessimistic slope kept
    # at k = 0 would never be corrected: measured, services stuck at k = 0 for whole runs). ``last_*`` keep
    # the last line the spread allowed, for the heads' node budget: a heads loop verifies trees of one size
    # round after round, and a slope of 0 would price every node as free.
    min_spread: float = 4.0
    max_tokens: int = 256  # larger batches are prefills: not what a round's cost is planned from
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    _slope: float = 0.0  # the last slope the spread of batch sizes allowed (0: none yet)
    _last_at: float | None = None  # the clock at the last observation

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > self.max_tokens:
            return
        now = self.clock()
        gap = 0.0 if self._last_at is None else now - self._last_at
        self._last_at = now
        d = self.decay ** max(1.0, gap / self.decay_period_s)
        self._w = d * self._w + 1.0
        self._x = d * self._x + tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * seconds
        if self._spread_ok():
            mx, my = self._x / self._w, self._y / self._w
            self._slope = max(0.0, (self._xy / self._w - mx * my) / (self._xx / self._w - mx * mx))

    @property
    def ready(self) -> bool:
        return self._w > 0

    def _spread_ok(self) -> bool:
        mx = self._x / self._w
        return self._xx / self._w - mx * mx >= self.min_spread**2

    @property
    def per_token_s(self) -> float:
        return self._slope if self.ready and self._spread_ok() else 0.0

    @property
    def base_s(self) -> float:
        return self._base_at(self.per_token_s)

    @property
    def last_per_token_s(self) -> float:
        """The last slope the spread of batch sizes allowed (0: none yet), kept while sizes stop varying."""
        return self._slope

    @property
    def last_base_s(self) -> float:
        """The intercept that goes with ``last_per_token_s``."""
        return self._base_at(self._slope)

    def _base_at(self, slope: float) -> float:
        if not self.ready:
            return 0.0
        return max(1e-6, self._y / self._w - slope * self._x / self._w)

    def seconds(self, tokens: int) -> float:
        """The fitted cost of a pass of ``tokens`` tokens (the weights read once, however few)."""
        return self.base_s + self.per_token_s * tokens


@dataclass(slots=True)
class PromptTokenCost:
    """What prompt tokens add to the forward pass that carries them: ``fixed_s + per_token_s * tokens``.

    ``ForwardCostFit`` fits decode and verify steps, where a token adds little (the weights are
    read once for all of them). A prompt token costs its arithmetic, and a prompt run also pays
    a part that does not shrink with it: attention over the context once per layer, whatever the
    run holds of a piece (tandem/attention/sdpa.py), which grows with the context. Each pass
    that carries prompt tokens (``ForwardItem.prompt``) gives what it cost beyond its other rows'
    fitted cost. Passes of at least ``min_tokens`` prompt tokens (whole prefills, long chunks)
    price a token; shorter ones (chunks beside running streams, what the prefix cache left of a
    prompt) give the fixed part, what they cost beyond their tokens' price. Both are weighted
    exponentially per pass, so they follow the context a long prompt's chunks have reached.

    Measured on Qwen2.5-Coder-1.5B (bf16, 2-core Xeon) beside 4 decode rows at a context of
    3,800, pieces of 4: 1 prompt token adds 57 ms, 2 add 61 ms, 4 add 102 ms, 8 add 166 ms; a
    whole prefill costs 15 ms a token. So about 45 ms is fixed there, and a price per token
    alone, measured on the chunks, shrank chunks to one token a step (tried, with pieces of 8: a
    4,000-token prompt then took 1,622 steps).
    """

    min_tokens: int = 32  # passes with at least this many prompt tokens price a token
    decay: float = 0.8  # weight of the past per pass
    _tokens: float = 0.0
    _seconds: float = 0.0
    _short: float = 0.0
    _fixed: float = 0.0

    def observe(self, prompt_tokens: int, extra_s: float) -> None:
        """A pass carried ``prompt_tokens`` and cost ``extra_s`` more than its other rows alone would."""
        if prompt_tokens <= 0:
            return
        d, extra = self.decay, max(0.0, extra_s)
        if prompt_tokens >= self.min_tokens:
            self._tokens = d * self._tokens + prompt_tokens
            self._seconds = d * self._seconds + extra
        elif self.ready:
            self._short = d * self._short + 1.0
            self._fixed = d * self._fixed + max(0.0, extra - self.per_token_s * prompt_tokens)

    def reset(self) -> None:
        """Forget every pass (the warm-up's first one, which paid for touching the KV pages)."""
        self._tokens = self._seconds = self._short = self._fixed = 0.0

    @property
    def ready(self) -> bool:
        """Whether a token has been priced (a pass of at least ``min_tokens`` prompt tokens seen)."""
        return self._tokens > 0

    @property
    def per_token_s(self) -> float:
        return self._seconds / self._tokens if self._tokens else 0.0

    @property
    def fixed_s(self) -> float:
        return self._fixed / self._short if self._short else 0.0
