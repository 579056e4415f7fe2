"""Predicted outputs: proposals from text the client expects the answer to repeat (OpenAI's ``prediction``).

A client that asks for an edit of a file knows most of the answer before it is written: the file itself. It
sends that text as the request's prediction, and each round proposes what follows, in the prediction, the
longest suffix of the history that occurs there. Verification keeps what the target agrees with, as for any
proposal, so the answer is what it is without a prediction (greedy: token for token; sampled: in distribution,
or the seeded draws exactly); where it copies the prediction a round commits up to k + 1 tokens in one
target forward.

Where the answer departs from the prediction (the edit itself), proposals fail or stop until the history's
suffix occurs in the prediction again, and resume there. The text indexed is the prompt's last
``PROMPT_CONTEXT`` tokens followed by the prediction, so that the answer's first round matches across the
boundary (a chat template's assistant header) and proposes the prediction's first tokens; proposals are only
ever taken from the prediction.

A prediction is read front to back: where the suffix occurs more than once (a line that repeats in the file),
the first occurrence after where the last match stood wins (the history has grown by at least a token since),
so the proposals move forward through the file as the answer does; with none there, the last one before it
(an answer that goes back to repeat an earlier part). (The request's own prompt lookup,
``tandem.spec.ngram``, takes the latest occurrence instead: in its own growing text that is the likeliest.)
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

# Prompt tokens indexed before the prediction: enough for a chat template's assistant header (Qwen's
# "<|im_start|>assistant\n" is 3 tokens), so the first round matches it and proposes the prediction's start.
PROMPT_CONTEXT = 8


class PredictionIndex:
    """One request's prediction, indexed by n-gram for ``lookup``; built per size on first use.

    Memory: one list entry per prediction token and n-gram size looked up (sizes 1..4: about 4 x 100 bytes a
    token); a prediction is at most the model's context long (the coordinator refuses longer ones).
    Not thread-safe: the request's loop uses it from its one thread.
    """

    def __init__(self, prompt_ids: Sequence[int], prediction_ids: Sequence[int]) -> None:
        if not prediction_ids:
            raise ValueError("an empty prediction proposes nothing: leave it out")
        tail = list(prompt_ids[-PROMPT_CONTEXT:])
        self._text = [*tail, *prediction_ids]
        self._start = len(tail)  # where the prediction starts in _text: proposals come from here on
        self._follow: dict[tuple[int, ...], list[int]] = {}  # n-gram -> the positions after it, ascending
        self._sizes: set[int] = set()
        self._cursor = self._start - 1  # where the last match's continuation started (none yet: before the start)

    def __len__(self) -> int:
        """The prediction's tokens."""
        return len(self._text) - self._start

    def lookup(self, history: Sequence[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
        """Up to ``k`` prediction tokens that follow the longest suffix of ``history`` (``min_n``..``max_n``
        tokens) found in the indexed text, and that suffix's length; ``([], 0)`` where none occurs."""
        if k <= 0:
            return [], 0
        if min_n < 1:
            raise ValueError(f"n-gram sizes must be >= 1, got {min_n}..{max_n}")
        for n in range(min(max_n, len(history)), min_n - 1, -1):
            self._index(n)
            positions = self._follow.get(tuple(history[len(history) - n:]))
            if positions:
                i = bisect_right(positions, self._cursor)
                at = positions[i] if i < len(positions) else positions[-1]
                self._cursor = at
                return self._text[at:at + k], n
        return [], 0

    def _index(self, n: int) -> None:
        """Record, for every n-gram of the text that a prediction token follows, where that token stands."""
        if n in self._sizes:
            return
        self._sizes.add(n)
        text, follow = self._text, self._follow
        for at in range(max(n, self._start), len(text)):
            follow.setdefault(tuple(text[at - n:at]), []).append(at)
