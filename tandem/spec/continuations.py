"""What followed short contexts in every request's text: the local tier of the continuation cache.

Structure: one table from a *context* (the ``n`` tokens before a position,
``min_n <= n <= max_n``) to the few *runs* (the next ``max_continuation``
tokens) that followed it, each with a count. A lookup tries the longest suffix
of the caller's context first (``max_n`` down to ``min_n``); the first context
in the table wins and its runs are merged greedily into one continuation: at
each depth the token whose runs have the largest total count, then only the
runs that agree with it. So "the most frequent continuation" is decided token
by token (runs that share a prefix add up) while the answer still comes from
ONE table probe per order, never a walk over many nodes.

Why whole runs and not next-token counts (a trie or a Markov chain assembled
step by step): the shared tier over Redis must answer in one round trip, and
a run per context is what a single read can return (a token-by-token walk
would need k dependent reads); keeping the same model in both tiers lets a
shared answer be stored locally as is and keeps the two tiers' answers
comparable (same match length, same counts). A lookup costs at most
``max_n - min_n + 1`` dict probes plus the merge of at most ``max_runs`` runs.

Learning is incremental: a run is known only once ``max_continuation`` more
tokens exist, so ``learn`` records the contexts whose runs became complete
with the new tokens, and ``final=True`` (the sequence's last call) also
records the last positions with the shorter runs they have. Each learned
token costs ``max_n - min_n + 1`` table updates (a few microseconds in all),
and a call reads (packs) only the tail those need (``learn_offset``), so a
growing sequence learned every round costs its new tokens, not its length.

Encoding: token ids are packed as 3 bytes each, little-endian (ids below
2**24 = 16,777,216, far above any vocabulary in use): every context key is a
slice of the packed sequence, a 16-token run with its header fits Redis's
compact 64-byte listpack limit, and the runs for all orders ending at one
position are the same bytes object (memory is shared, not copied).

Bounds: at most ``max_entries`` contexts (LRU over learn and lookup), at most
``max_runs`` runs per context (a new run replaces the least frequent one).
Measured with tracemalloc (tests/spec/test_continuations.py) at the defaults:
about ``TYPICAL_ENTRY_BYTES`` per entry on text-like sequences, at most
``MAX_ENTRY_BYTES`` when every entry holds ``max_runs`` distinct runs; so
200,000 entries take ~52 MB typically and at most ~144 MB.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

TOKEN_BYTES = 3
MAX_TOKEN_ID = (1 << (8 * TOKEN_BYTES)) - 1
TYPICAL_ENTRY_BYTES = 260  # measured: one run per context, runs shared across the orders of a position
MAX_ENTRY_BYTES = 720  # measured: max_runs distinct 16-token runs per context, none shared, counts > 256
_NUMPY_PACK_MIN = 64  # below this many tokens, packing in Python beats numpy's call overhead

LOCAL = "local"
SHARED = "shared"


@dataclass(slots=True, frozen=True)
class CacheHit:
    """A proposed continuation and how much evidence backs it."""

    tokens: list[int]  # proposed continuation, 1..k tokens
    match_len: int  # length of the context that matched
    count: int  # how often this continuation followed that context
    source: str  # "local" or "shared"
    # Every run that followed that context, most frequent first, each cut to k tokens: the branches
    # of a token tree (a sampled request parts from the most frequent run where earlier samples did).
    # Not part of a hit's equality: two hits that propose the same are the same answer.
    runs: tuple[tuple[int, ...], ...] = field(default=(), compare=False)


@dataclass(slots=True)
class LocalStats:
    """Counters of one local tier (plain ints: read them, never reset them concurrently)."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    learned: int = 0  # (context, run) observations recorded
    evictions: int = 0


# ----- token packing ------------------------------------------------------
def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as 3-byte little-endian groups; ids outside 0..2**24-1 raise ``ValueError``."""
    if len(tokens) < _NUMPY_PACK_MIN:
        try:
            return b"".join(int(t).to_bytes(TOKEN_BYTES, "little") for t in tokens)
        except OverflowError:
            raise ValueError(f"token ids must be in 0..{MAX_TOKEN_ID}") from None
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 1 or int(ids.min()) < 0 or int(ids.max()) > MAX_TOKEN_ID:
        raise ValueError(f"token ids must be a flat sequence in 0..{MAX_TOKEN_ID}")
    return ids.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :TOKEN_BYTES].tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    """The inverse of ``pack_tokens`` (``len(data)`` must be a multiple of 3)."""
    return [int.from_bytes(data[i : i + TOKEN_BYTES], "little") for i in range(0, len(data), TOKEN_BYTES)]


# ----- what a sequence teaches ------------------------------------------------
def learn_offset(start: int, orders: Sequence[int], max_continuation: int) -> int:
    """The first token a learn from ``start`` reads: ``continuation_items`` of ``tokens[offset:]`` from
    ``start - offset`` are those of ``tokens`` from ``start``.

    The positions reported begin ``max_continuation - 1`` before ``start`` (their runs were incomplete
    then) and their contexts ``max(orders)`` before those; nothing earlier is read.
    """
    return max(0, start - max_continuation + 1 - max(orders, default=0))


def continuation_items(packed: bytes, start: int, final: bool, orders: Sequence[int],
                       max_continuation: int) -> Iterator[tuple[bytes, bytes]]:
    """(context, run) pairs of a packed sequence that became known since its first ``start`` tokens.

    A position ``e`` (the run starts there) is reported once its run is complete
    (``e + max_continuation <= length``) and was not complete at ``start``
    tokens; with ``final`` the positions whose runs can no longer grow are
    reported too, with what they have. ``orders``: the context lengths to emit.
    """
    b, m = TOKEN_BYTES, max_continuation
    length = len(packed) // b
    spans = sorted(b * n for n in orders)  # ascending: stop at the first that does not fit
    first = max(min(orders, default=1), start - m + 1)
    last = length - 1 if final else length - m
    for end in range(b * first, b * (last + 1), b):
        run = packed[end : end + b * m]  # one object for every order at this position
        for span in spans:
            if span > end:
                break
            yield packed[end - span : end], run


def best_continuation(runs: Sequence[tuple[bytes, int]], k: int) -> tuple[bytes, int]:
    """Merge (run, count) pairs into the most frequent continuation of up to ``k`` tokens.

    At each depth the token with the largest total count among the runs still
    agreeing with what was chosen so far (ties: the one met first, so order
    ``runs`` by count). Returns the packed continuation and how often it
    followed (the total count of the runs that contain all of it).
    """
    b = TOKEN_BYTES
    alive = [r for r in runs if r[0]]
    depth = 0
    while depth < k and len(alive) > 1:
        at = b * depth
        totals: dict[bytes, int] = {}
        for run, count in alive:
            if len(run) > at:
                token = run[at : at + b]
                totals[token] = totals.get(token, 0) + count
        if not totals:
            break
        chosen = max(totals, key=totals.__getitem__)  # max keeps the first of equals: insertion order
        alive = [(r, c) for r, c in alive if r[at : at + b] == chosen]
        depth += 1
    if not alive:
        return b"", 0
    if len(alive) == 1:  # one run left: the rest of it, as far as k allows
        run, count = alive[0]
        return run[: b * k], count
    return alive[0][0][: b * depth], sum(c for _, c in alive)


def unpack_runs(runs: Sequence[bytes], k: int) -> tuple[tuple[int, ...], ...]:
    """The first ``k`` tokens of each packed run, in order (a ``CacheHit``'s ``runs``)."""
    return tuple(tuple(unpack_tokens(run[: TOKEN_BYTES * k])) for run in runs if run)


# ----- the local tier ---------------------------------------------------------
class LocalContinuations:
    """In-process, bounded table of the runs that followed each context, for one tokenizer.

    Not thread-safe: use it from one thread (the coordinator's event loop).
    ``namespace`` is the tokenizer fingerprint; one instance never holds two.
    """

    def __init__(self, namespace: str, max_entries: int = 200_000, min_n: int = 2, max_n: int = 8,
                 max_continuation: int = 16, max_runs: int = 4) -> None:
        if not namespace:
            raise ValueError("namespace (the tokenizer fingerprint) must not be empty")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"context lengths need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        if max_entries < 1 or max_continuation < 1 or max_runs < 1:
            raise ValueError("max_entries, max_continuation and max_runs must be >= 1")
        self.namespace = namespace
        self.max_entries = max_entries
        self.min_n, self.max_n = min_n, max_n
        self.max_continuation = max_continuation
        self.max_runs = max_runs
        self.orders = tuple(range(min_n, max_n + 1))
        # packed context -> flat [run, count, run, count, ...], counts descending (flat: fewer objects)
        self._entries: OrderedDict[bytes, list] = OrderedDict()
        self._stats = LocalStats()

    # ----- sizes and counters ------------------------------------------------
    @property
    def size(self) -> int:
        """Contexts held now (at most ``max_entries``)."""
        return len(self._entries)

    @property
    def approx_bytes(self) -> int:
        """Estimated memory held now (typical entry size; see the module docstring)."""
        return len(self._entries) * TYPICAL_ENTRY_BYTES

    @property
    def max_bytes(self) -> int:
        """Estimated worst-case memory when full."""
        return self.max_entries * MAX_ENTRY_BYTES

    @property
    def stats(self) -> LocalStats:
        """A copy of the counters."""
        s = self._stats
        return LocalStats(s.lookups, s.hits, s.misses, s.learned, s.evictions)

    # ----- learning -----------------------------------------------------------
    def learn(self, tokens: Sequence[int], start: int = 0, *, final: bool = False) -> int:
        """Record what ``tokens`` teach beyond their first ``start`` tokens; returns observations added.

        Feed a growing sequence by calling again with ``start`` = its length at
        the previous call; pass ``final=True`` on its last call (or on a
        finished sequence learned at once) so its last positions count too.
        A sequence learned twice from the same ``start`` is counted twice.
        Only the tail that the new observations need is read (``learn_offset``).
        """
        skip = learn_offset(start, self.orders, self.max_continuation)
        return self.learn_packed(pack_tokens(tokens[skip:]), start - skip, final=final)

    def learn_packed(self, packed: bytes, start: int = 0, *, final: bool = False) -> int:
        """``learn`` for a sequence already packed with ``pack_tokens``."""
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        return self.add_items(continuation_items(packed, start, final, self.orders, self.max_continuation))

    def add_items(self, items: Iterable[tuple[bytes, bytes]]) -> int:
        """Record (packed context, packed run) observations, e.g. from ``continuation_items``."""
        add = self._add
        added = 0
        for context, run in items:
            add(context, run)
            added += 1
        self._stats.learned += added
        return added

    def absorb(self, context: bytes, run: bytes) -> None:
        """Remember a continuation found elsewhere (the shared tier) as one observation.

        ``context`` is the packed context that matched, ``run`` its packed
        continuation. Besides ``context -> run``, every later position of
        ``run`` is recorded under the longest context inside ``context + run``,
        so the following rounds of the request continue from here with the
        match lengths the evidence supports, without asking the shared tier.
        """
        b = TOKEN_BYTES
        seq = context + run
        first, length = len(context) // b, len(seq) // b
        for e in range(first, length):
            n = min(self.max_n, e)
            if n >= self.min_n:
                self._add(seq[b * (e - n) : b * e], seq[b * e : b * (e + self.max_continuation)])

    def _add(self, context: bytes, run: bytes) -> None:
        entries = self._entries
        entry = entries.get(context)
        if entry is None:
            entries[context] = [run, 1]
            if len(entries) > self.max_entries:
                entries.popitem(last=False)
                self._stats.evictions += 1
            return
        entries.move_to_end(context)
        for i in range(0, len(entry), 2):
            if entry[i] == run:
                entry[i + 1] += 1
                while i and entry[i + 1] > entry[i - 1]:  # keep counts descending: one step per win
                    entry[i - 2 : i + 2] = entry[i : i + 2] + entry[i - 2 : i]
                    i -= 2
                return
        if len(entry) < 2 * self.max_runs:
            entry += (run, 1)
        else:  # full: the new run takes the least frequent one's place
            entry[-2], entry[-1] = run, 1

    # ----- lookup ---------------------------------------------------------------
    def lookup(self, context: Sequence[int], k: int) -> CacheHit | None:
        """The continuation (up to ``k`` tokens) of the longest known suffix of ``context``."""
        if k <= 0 or len(context) < self.min_n:
            self._stats.lookups += 1
            self._stats.misses += 1
            return None
        return self.lookup_packed(pack_tokens(list(context[-self.max_n :])), k)

    def lookup_packed(self, tail: bytes, k: int) -> CacheHit | None:
        """``lookup`` for a context already packed (only its last ``max_n`` tokens are used)."""
        found = self.match_packed(tail, k)
        self._stats.lookups += 1
        if found is None:
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        n, tokens, count, runs = found
        return CacheHit(unpack_tokens(tokens), n, count, LOCAL, unpack_runs(runs, k))

    def match_packed(self, tail: bytes, k: int) -> tuple[int, bytes, int, list[bytes]] | None:
        """(match length, packed continuation, count, the context's runs) of the longest known suffix, or None."""
        if k <= 0:
            return None
        b, entries = TOKEN_BYTES, self._entries
        length = len(tail) // b
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            key = tail[b * (length - n) :]
            entry = entries.get(key)
            if entry is not None:
                entries.move_to_end(key)
                tokens, count = best_continuation(list(zip(entry[::2], entry[1::2])), k)
                if tokens:
                    return n, tokens, count, entry[::2]
        return None
