"""How much of a long prompt one batch step computes while other streams are running (chunked prefill).

A prompt fed as one run holds every other stream on its worker for the whole of its prefill: on
a 2-core CPU a 4,000-token prompt of a 1.5B model is tens of seconds without a token for anyone
else. Fed in chunks, one per batch step beside the running streams' decode and verify rows, it
delays each of their steps by one chunk's cost instead.

The chunk's size trades the running streams' gaps against the new prompt's time to first token
(small chunks use the matrix units less well). A step costs about ``base_s + per_token_s * tokens``
(the engine's fitted cost, ``tandem.cost_fit``); a chunk of ``AUTO_STEP_FRACTION * base_s /
per_token_s`` tokens makes a step at most that fraction dearer than a step without it, whatever
the hardware: a few dozen tokens on a CPU (where weights dominate a step less), hundreds on a GPU.
Chunks are whole KV blocks, so every chunk boundary is a block boundary, as the prefix cache's are;
a chunk, and what a chunk leaves of the prompt, is at least ``MIN_PROMPT_RUN`` tokens, so that every
row of a chunked prompt goes through the attention path it takes in one run (bitwise the same rows).

A prompt arriving while no other sequence is running is computed whole: nobody waits on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.cost_fit import ForwardCostFit
from tandem.rpc.sequence_engine import MIN_PROMPT_RUN

# A chunk makes a step at most this much dearer (0.75: the running streams' gaps stay under 1.75x).
AUTO_STEP_FRACTION = 0.75
# Until the cost fit has samples (the first seconds after warm-up): a chunk this long.
UNFITTED_CHUNK_TOKENS = 256


@dataclass(slots=True)
class PrefillChunks:
    """``tokens``: a fixed chunk size; None: measured (``AUTO_STEP_FRACTION``); 0: never chunk."""

    tokens: int | None
    block_size: int
    cost_fit: ForwardCostFit

    def __post_init__(self) -> None:
        if self.tokens is not None and self.tokens < 0:
            raise ValueError(f"prefill chunk size must be >= 0 tokens (0: no chunking), got {self.tokens}")

    @property
    def enabled(self) -> bool:
        return self.tokens != 0

    def size(self) -> int:
        """Tokens of one chunk now: whole blocks, at least ``MIN_PROMPT_RUN`` (0 when chunking is off)."""
        if self.tokens == 0:
            return 0
        if self.tokens is not None:
            tokens = self.tokens
        elif not self.cost_fit.ready or self.cost_fit.per_token_s <= 0:
            tokens = UNFITTED_CHUNK_TOKENS
        else:
            tokens = int(AUTO_STEP_FRACTION * self.cost_fit.base_s / self.cost_fit.per_token_s)
        smallest = -(-MIN_PROMPT_RUN // self.block_size) * self.block_size
        return max(smallest, tokens // self.block_size * self.block_size)

    def take(self, left: int) -> int:
        """Of ``left`` prompt tokens still to compute, how many this step: a chunk, or all of them when
        a chunk would leave fewer than ``MIN_PROMPT_RUN`` (or chunking is off)."""
        size = self.size()
        return size if size and left - size >= MIN_PROMPT_RUN else left
