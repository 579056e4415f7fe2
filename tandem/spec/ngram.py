"""Prompt lookup: propose what followed the last earlier occurrence of the sequence's suffix.

Longest match first: try suffixes of ``max_n`` tokens down to ``min_n``; the
first n with an earlier occurrence wins, and the (up to k) tokens that
followed it are the proposal. An occurrence is earlier when at least one token
follows it inside the sequence (it may overlap the suffix itself).

Two implementations of the same answers:

- ``lookup_match`` / ``lookup_continuations``: one-shot, a vectorised scan of
  the whole sequence (offline replays, one-off calls);
- ``NgramIndex``: one request's growing history, indexed as it grows. Every
  call indexes only the tokens appended since the last one, then answers
  with one dict probe per n-gram size, so a round costs the same at 100 or
  8,000 tokens of history (the scan re-read the whole history every round,
  on the coordinator's one event-loop thread: quadratic work per request).
  (SuffixDecoding keeps a per-request suffix tree for the same reason.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# What followed one n-gram: the position of the token after its latest occurrence when only one
# token ever followed it (the common case, and a third of the memory of a dict), else a dict
# {following token: position of that token after the latest occurrence it followed}, oldest first.
_Followers = int | dict[int, int]


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


class NgramIndex:
    """One request's history, indexed for prompt lookup as it grows: ``lookup_match`` without the scan.

    For every n-gram size asked for so far, each n-gram that has a following
    token maps to where what followed it stands: per distinct following token,
    the position after its latest occurrence, most recent last. That is all the
    scan's answers need: the latest occurrence of the longest suffix (the most
    recent entry), and, for trees, the most recent occurrence per distinct first
    token. Answers equal ``lookup_match`` / ``lookup_continuations`` on the
    same history (tests/spec/test_ngram_index.py compares them on random ones).

    Give every call the same growing history (appended to, never edited: the
    loop's ``RequestState.history``). Each call indexes what was appended since
    the previous one (n-gram sizes x new tokens dict updates); a history that
    shrank or whose last indexed token changed is indexed afresh, so a misuse
    costs time, never a wrong answer. An n-gram size asked for the first time
    indexes the history once for it. Memory (tracemalloc): at most about 110 bytes
    per token and size (every n-gram distinct: its tuple, the position, a dict
    slot); 59 bytes per token for sizes 1..4 on recorded model output (repeats
    share entries). Not thread-safe: the loop's one thread uses it.
    """

    def __init__(self) -> None:
        self._follow: dict[tuple[int, ...], _Followers] = {}  # every size's n-grams: lengths keep them apart
        self._sizes: list[int] = []  # n-gram sizes indexed
        self._indexed = 0  # tokens of the history indexed
        self._last: object = None  # the last of them (an edited history shows here)

    @property
    def indexed(self) -> int:
        """How many tokens of the history are indexed."""
        return self._indexed

    def lookup_match(self, history: Sequence[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
        """``lookup_match(history, k, min_n, max_n)``, after indexing what ``history`` gained."""
        if k <= 0:
            return [], 0
        self._update(history, min_n, max_n)
        length = len(history)
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            followers = self._follow.get(tuple(history[length - n :]))
            if followers is not None:
                start = followers if isinstance(followers, int) else next(reversed(followers.values()))
                return list(history[start : start + k]), n
        return [], 0

    def lookup_continuations(self, history: Sequence[int], k: int, min_n: int, max_n: int,
                             limit: int) -> list[tuple[list[int], int]]:
        """``lookup_continuations(history, k, min_n, max_n, limit)``, after indexing what ``history`` gained.

        Per size, only the latest occurrence of each following token can be a branch (an older
        one has a first token already taken), so at most ``2 * limit`` entries are read per size.
        """
        if k <= 0 or limit <= 0:
            return []
        self._update(history, min_n, max_n)
        length = len(history)
        found: list[tuple[list[int], int]] = []
        firsts: set[int] = set()
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            followers = self._follow.get(tuple(history[length - n :]))
            if followers is None:
                continue
            for start in (followers,) if isinstance(followers, int) else reversed(followers.values()):
                first = history[start]
                if first not in firsts:
                    firsts.add(first)
                    found.append((list(history[start : start + k]), n))
                    if len(found) == limit:
                        return found
        return found

    # ----- indexing -------------------------------------------------------------
    def _update(self, history: Sequence[int], min_n: int, max_n: int) -> None:
        """Index the tokens appended since the last call, and the sizes ``min_n..max_n`` not indexed yet."""
        if min_n < 1:
            raise ValueError(f"n-gram sizes must be >= 1, got {min_n}..{max_n}")
        length = len(history)
        if length < self._indexed or (self._indexed and history[self._indexed - 1] != self._last):
            self._follow.clear()  # not the history indexed so far: start again
            self._indexed = 0
        new_sizes = [n for n in range(min_n, max_n + 1) if n not in self._sizes]
        if new_sizes and self._indexed:
            self._add(history, new_sizes, 1, self._indexed)  # the new sizes catch up, once
        self._sizes += new_sizes
        if length > self._indexed:
            self._add(history, self._sizes, max(1, self._indexed), length)
            self._indexed = length
            self._last = history[length - 1]

    def _add(self, history: Sequence[int], sizes: Sequence[int], begin: int, end: int) -> None:
        """Record the token at each position p in ``begin..end-1`` as what followed each n-gram ending at p-1."""
        follow = self._follow
        for p in range(begin, end):
            token = history[p]
            for n in sizes:
                if n > p:
                    continue
                key = tuple(history[p - n : p])
                followers = follow.get(key)
                if followers is None:
                    follow[key] = p
                elif isinstance(followers, int):
                    before = history[followers]
                    follow[key] = p if before == token else {before: followers, token: p}
                else:
                    followers.pop(token, None)  # re-inserted last: the dict stays in order of recency
                    followers[token] = p
