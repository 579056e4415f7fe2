"""How much of a long prompt one batch step computes while other streams are running (chunked prefill).

A prompt fed as one run holds every other stream on its worker for the whole of its prefill: on
a 2-core CPU a 4,000-token prompt of a 1.5B model is about a minute without a token for anyone
else. Fed in chunks, one per batch step beside the running streams' decode and verify rows, it
delays each of their steps by one chunk's cost instead. Used by the target and the draft workers.

The chunk's size trades the running streams' gaps against the new prompt's time to first token.
A step of the running streams costs at least ``base_s`` (``tandem.cost_fit.ForwardCostFit``: the
weights read once); a chunk of n prompt tokens adds ``fixed_s + n * per_token_s``
(``tandem.cost_fit.PromptTokenCost``, measured on this worker's own prompt passes, chunks
included). The chunk is the largest that adds at most ``AUTO_STEP_FRACTION * base_s``, and at
least one token: a handful of tokens on a 2-core CPU, where a prompt token costs a tenth of a
step, hundreds on a GPU, where a step is bound by reading the weights. Since the fixed part is
measured on the chunks themselves, the size follows the prompt: deep into a long prompt, a
chunk attends over more keys and the chunks get shorter.

A chunk may be any number of tokens: prompt tokens are attended by position (tandem/attention/sdpa.py),
so a prompt's rows are bitwise the same in one run or in chunks of any size.

A prompt arriving while no other sequence is running (a lone prompt) is cut too, in larger chunks:
nobody waits on it now, but a request arriving during its prefill would wait for all of it (a
5,000-token prompt of the 1.5B target in fp32 on a 2-core CPU: 150 s before the newcomer's first
step). Between chunks the newcomer joins (the step that reads its prompt gives the long one a
running-size chunk), and the rest of the prompt goes on in running-size chunks beside it; a call
whose client gave up is dropped there too (``tandem.rpc.batcher``). A lone chunk pays the weights
once more than one run would (``base_s``, and the fixed part), so it is the smallest that keeps
that below ``LONE_OVERHEAD`` of its tokens' cost, and never one that costs less than
``LONE_CHUNK_S`` (a wait nobody notices): on that CPU chunks of about 200 tokens (6 s); on a GPU,
where a prompt token costs microseconds, whole prompts of up to tens of thousands of tokens.
Until a prompt token has been priced, a lone prompt goes whole.

Prompts that arrive together (a burst) share one lone chunk's tokens per step (``take_lone``): the
prompts whose rest fits in it finish now, shortest first, and while none does the oldest takes the
lone chunk; every other takes a running-size chunk. Cut one lone chunk each, fifteen 2,000-token
prompts of the tiny test model made one 30,000-token step of 4.5 s, 15 times a lone chunk's wait for
anyone arriving then, and since each prompt had a share of every step, all of them finished at the
burst's end. Now the oldest finishes first (first come, first served).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.attention.sdpa import PIECE
from tandem.cost_fit import ForwardCostFit, PromptTokenCost

# A chunk adds at most this fraction of a step's base cost: a step with a chunk costs at most 1.8x one without
# (less beside more streams, whose rows the base leaves out). See benchmarks/README.md, "Prefix caching,
# placement and chunked prefill".
AUTO_STEP_FRACTION = 0.8
# Until a prompt token's price is measured (no prompt computed yet): a chunk this long.
UNFITTED_CHUNK_TOKENS = 256
# However cheap prompt tokens look (a GPU's passes of a few hundred tokens cost no more than one of one).
MAX_AUTO_CHUNK_TOKENS = 2048
# A lone prompt's chunks: each costs its prompt at most this fraction of its tokens' cost in extra passes...
LONE_OVERHEAD = 0.05
# ... and none costs less than this many seconds (the longest a newcomer then waits is about one chunk).
LONE_CHUNK_S = 1.0


@dataclass(slots=True)
class PrefillChunks:
    """``tokens``: a fixed chunk size; None: measured (``AUTO_STEP_FRACTION``); 0: never chunk."""

    tokens: int | None
    cost_fit: ForwardCostFit
    prompt_cost: PromptTokenCost

    def __post_init__(self) -> None:
        if self.tokens is not None and self.tokens < 0:
            raise ValueError(f"prefill chunk size must be >= 0 tokens (0: no chunking), got {self.tokens}")

    @property
    def enabled(self) -> bool:
        return self.tokens != 0

    def size(self) -> int:
        """Tokens of one chunk now, at least 1 (0 when chunking is off)."""
        if self.tokens is not None:
            return self.tokens
        price = self.prompt_cost
        if not price.ready or price.per_token_s <= 0 or not self.cost_fit.ready:
            return UNFITTED_CHUNK_TOKENS
        room = AUTO_STEP_FRACTION * self.cost_fit.base_s - price.fixed_s  # seconds a chunk's tokens may add
        return max(1, min(MAX_AUTO_CHUNK_TOKENS, int(room / price.per_token_s)))

    def lone_size(self) -> int | None:
        """Tokens of one chunk of a lone prompt (module doc), at least ``size()``; None: the prompt goes whole
        (chunking off, or no prompt token priced yet)."""
        price = self.prompt_cost
        if not self.enabled or not price.ready or price.per_token_s <= 0:
            return None
        extra_s = (self.cost_fit.base_s if self.cost_fit.ready else 0.0) + price.fixed_s  # one more pass's price
        tokens = max(LONE_CHUNK_S, extra_s / LONE_OVERHEAD) / price.per_token_s
        return max(self.size(), int(min(tokens, 2**31)))

    def take_lone(self, spans: Sequence[tuple[int, int]]) -> list[int]:
        """How many tokens of each prompt one step computes while no other sequence runs; ``spans``: each prompt's
        (tokens left, from position), oldest first. The prompts share one lone chunk (module doc): those whose rest
        fits in it finish, shortest first; if none does, the oldest takes a lone chunk (``take(..., lone=True)``);
        every other prompt takes a running-size chunk (``take``), so that one finishing now is not held up by the
        others. Unpriced prompt tokens (``lone_size`` None): every prompt whole."""
        room = self.lone_size()
        if room is None:
            return [left for left, _ in spans]
        now = [0] * len(spans)
        for i in sorted(range(len(spans)), key=lambda i: spans[i][0]):
            if spans[i][0] <= room:
                now[i], room = spans[i][0], room - spans[i][0]
        oldest_lone = not any(now)
        for i, (left, start) in enumerate(spans):
            if not now[i]:
                now[i] = self.take(left, start, lone=oldest_lone)
                oldest_lone = False
        return now

    def take(self, left: int, start: int, lone: bool = False) -> int:
        """Of ``left`` prompt tokens still to compute from position ``start``, how many this step: a chunk
        (``lone``: a lone prompt's, ``lone_size``), or all of them (the last chunk, or chunking off).

        Chunks tile prompt attention's pieces (``PIECE`` positions, a power of two): a piece is one
        attention call per layer whatever the chunk holds of it, so a chunk that straddled a boundary
        would pay two, and a piece cut 3 + 1 would pay twice for four tokens. So a chunk is a multiple
        of ``PIECE``, or a power of two below it; a start off a boundary first goes to the boundary. A lone
        chunk, whose passes cost most, ends on the last boundary it reaches instead.
        """
        size = self.size() if not lone else self.lone_size()
        if size is None or not 0 < size < left:
            return left
        end = (start + size) // PIECE * PIECE
        if lone and end > start:
            return end - start
        to_boundary = -start % PIECE
        if to_boundary:
            return min(size, to_boundary)
        if size >= PIECE:
            return size // PIECE * PIECE
        return 1 << (size.bit_length() - 1)
