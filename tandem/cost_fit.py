"""The measured cost of a model's forward pass, fitted online: what adaptive k plans with.

An engine fits it over its own batches and workers report it in Info. It is
plain arithmetic (no torch), so the coordinator reads the same type.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ForwardCostFit:
    """Seconds of one forward pass as a line in the tokens it carries: ``base_s + per_token_s * tokens``.

    A worker fits it online over its own batches (least squares on
    exponentially weighted sums, so it follows load and thermal drift) and
    reports it in Info. The intercept is the cost of reading the weights once,
    the slope what each extra token adds: at batch 1 the slope is small and
    speculation is nearly free; with many streams batched, every draft token
    of every stream adds ``per_token_s`` and speculation can stop paying.

    Only batches of up to ``max_tokens`` are fitted: the cost is not a line
    over all sizes. Small batches are bound by reading the weights (measured:
    1 to 8 tokens add 2.7 ms each to a 121 ms pass), prompt prefills by
    compute (several ms per token), and a line through both would charge
    every draft token a prefill's price and talk adaptive k out of drafting.
    """

    decay: float = 0.98  # weight of the past per observation
    min_spread: float = 4.0  # tokens: below this spread of batch sizes the slope is not trusted
    max_tokens: int = 256  # larger batches are prefills: not what a round's cost is planned from
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > self.max_tokens:
            return
        d = self.decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * seconds

    @property
    def ready(self) -> bool:
        return self._w > 0

    @property
    def per_token_s(self) -> float:
        if not self.ready:
            return 0.0
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var < self.min_spread**2:
            return 0.0
        return max(0.0, (self._xy / self._w - mx * my) / var)

    @property
    def base_s(self) -> float:
        if not self.ready:
            return 0.0
        return max(1e-6, self._y / self._w - self.per_token_s * self._x / self._w)
