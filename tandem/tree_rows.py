"""Speculation trees as parent lists: which new tokens a tree row sees, and where it sits.

A sequence's new tokens in a forward pass may form a tree: ``parents[i]`` is the
index of token ``i``'s parent among the same sequence's new tokens, or -1 when it
follows the cached context directly. Parents come first (``parents[i] < i``), so
rows are in topological order. A row attends to the cached context, its ancestors
and itself, and sits at position ``context_len + depth``. A chain
(``[-1, 0, 1, ...]``) is the ordinary case: every row sees every row before it.

Plain lists, no torch: the engine validates and lays out a batch with these, and
the attention backends derive their per-row key sets from them.
"""

from __future__ import annotations

from collections.abc import Sequence


def chain_parents(num_tokens: int) -> list[int]:
    """The parents of ``num_tokens`` tokens in a row: ``[-1, 0, 1, ..., n-2]``."""
    return list(range(-1, num_tokens - 1))


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def parents_problem(parents: Sequence[int], num_tokens: int) -> str | None:
    """What is wrong with ``parents`` for ``num_tokens`` new tokens, or None when it is a valid tree."""
    if len(parents) != num_tokens:
        return f"{len(parents)} parents for {num_tokens} new tokens"
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            return f"parents[{i}] = {p} is outside -1..{i - 1} (a parent comes before its children)"
    return None


def depths(parents: Sequence[int]) -> list[int]:
    """Each row's depth: 0 for a row that follows the context directly, its parent's + 1 otherwise."""
    out: list[int] = []
    for p in parents:  # topological order: a parent's depth is known before its children's
        out.append(0 if p < 0 else out[p] + 1)
    return out


def path_to(parents: Sequence[int], row: int) -> list[int]:
    """The rows ``row`` sees among the new tokens: its ancestors in depth order, then itself."""
    path = [row]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def covering_paths(parents: Sequence[int]) -> list[tuple[list[int], int]]:
    """Root-to-node paths that together hold every row, and the rows each one is the first to hold.

    Deepest rows first: each row not yet held starts a path (its ancestors in depth order, then
    itself) and the path holds it and every ancestor not held by an earlier path. An ancestor is held
    whenever a descendant is, so the rows a path adds are a suffix of it: returns, per path, the
    path and the depth where that suffix starts. A deep tree of few branches needs few paths, which
    lets attention compute each path's rows as one chain (tandem/attention/sdpa.py).
    """
    level = depths(parents)
    held = [False] * len(parents)
    paths = []
    for row in sorted(range(len(parents)), key=lambda r: (-level[r], r)):
        if held[row]:
            continue
        path = path_to(parents, row)
        start = next(d for d, r in enumerate(path) if not held[r])
        for r in path[start:]:
            held[r] = True
        paths.append((path, start))
    return paths
