"""Prompt lookup: propose what followed the last earlier occurrence of the sequence's suffix.

Longest match first: try suffixes of ``max_n`` tokens down to ``min_n``; the
first n with an earlier occurrence wins, and the (up to k) tokens that
followed it are the proposal. No model, no state: cost is a vectorised scan.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def lookup_continuation(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens following the latest earlier match of the longest suffix (``min_n..max_n``)."""
    return lookup_match(tokens, k, min_n, max_n)[0]


def lookup_match(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """The continuation and the length n of the suffix that matched (0: no match)."""
    if k <= 0:
        return [], 0
    ids = np.asarray(tokens, dtype=np.int64)
    length = len(ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = ids[length - n :]
        # Windows starting at 0..length-n-1: every earlier place the suffix could stand.
        windows = np.lib.stride_tricks.sliding_window_view(ids[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent match: the likeliest continuation
            return ids[start : start + k].tolist(), n
    return [], 0


def lookup_continuations(tokens: Sequence[int], k: int, min_n: int, max_n: int,
                         limit: int) -> list[tuple[list[int], int]]:
    """Up to ``limit`` continuations with different first tokens, each with its match length.

    The branches of an n-gram token tree: longest match first and, for one length, the most
    recent first. The first is ``lookup_match``'s.
    """
    if k <= 0 or limit <= 0:
        return []
    ids = np.asarray(tokens, dtype=np.int64)
    length = len(ids)
    found: list[tuple[list[int], int]] = []
    firsts: set[int] = set()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = ids[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(ids[: length - 1], n)
        for hit in np.flatnonzero((windows == suffix).all(axis=1))[::-1]:
            start = int(hit) + n
            continuation = ids[start : start + k].tolist()
            if continuation[0] not in firsts:
                firsts.add(continuation[0])
                found.append((continuation, n))
                if len(found) == limit:
                    return found
    return found
