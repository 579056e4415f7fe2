"""Prompt lookup: propose what followed the last earlier occurrence of the sequence's suffix.

Longest match first: try suffixes of ``max_n`` tokens down to ``min_n``; the
first n with an earlier occurrence wins, and the (up to k) tokens that
followed it are the proposal. No model, no state: cost is a vectorised scan.
"""

from __future__ import annotations

from typing import Hashable

import numpy as np

from tandem.spec.proposal import Proposal, ProposeRequest


def lookup_continuation(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens following the latest earlier match of the longest suffix (``min_n..max_n``)."""
    return lookup_match(tokens, k, min_n, max_n)[0]


def lookup_match(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """The continuation and the length n of the suffix that matched (0: no match)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Windows starting at 0..length-n-1: every earlier place the suffix could stand.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent match: the likeliest continuation
            return tokens[start : start + k].tolist(), n
    return [], 0


class NgramProposer:
    """N-gram lookup over each request's own prompt and output."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.name = "ngram"

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        return [
            Proposal(lookup_continuation(np.asarray(r.tokens, dtype=np.int64), r.k, self.min_n, self.max_n))
            if r.k > 0
            else Proposal([])
            for r in requests
        ]

    def release(self, seq_id: Hashable) -> None:
        return None
