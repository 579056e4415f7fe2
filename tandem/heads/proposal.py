"""A heads' proposal for the next round: a token tree rooted after the last committed token, and how it is chosen.

Both head kinds score candidate tokens with a probability of their own; a node's
score is the product of those along its path (the chance, by the heads' own
confidence, that the whole path is accepted). The proposal keeps the ``budget``
best-scored nodes. A child never scores above its parent, so the kept set always
holds each node's ancestors: it is a tree (EAGLE-2's re-ranking; for Medusa the
same rule over the Cartesian product of each head's top tokens, which is what
Medusa's sparse trees approximate with accuracies measured offline).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(slots=True)
class HeadProposal:
    """Draft tokens (target ids) and each one's parent among them (-1: the last committed token), parents first."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # each node's path probability by the heads' confidence

    def __len__(self) -> int:
        return len(self.tokens)


def medusa_tree(candidates: list[list[tuple[int, float]]], budget: int) -> HeadProposal:
    """The ``budget`` best paths through per-depth candidates ``[depth][(token, prob)]`` (best first).

    Depth ``d``'s candidates follow any node at depth ``d - 1`` (Medusa's heads do not see
    the path before them). Best-first over path probabilities: every node popped is the best
    one left, and its children are pushed.
    """
    out = HeadProposal()
    if budget <= 0 or not candidates or not candidates[0]:
        return out
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, tie, depth, parent, token)
    tie = 0
    for token, prob in candidates[0]:
        heapq.heappush(heap, (-prob, tie, 0, -1, token))
        tie += 1
    while heap and len(out) < budget:
        neg, _, depth, parent, token = heapq.heappop(heap)
        node = len(out)
        out.tokens.append(token)
        out.parents.append(parent)
        out.scores.append(-neg)
        if depth + 1 < len(candidates):
            for child, prob in candidates[depth + 1]:
                heapq.heappush(heap, (neg * prob, tie, depth + 1, node, child))
                tie += 1
    return out


def best_nodes(parents: list[int], scores: list[float], tokens: list[int], budget: int) -> HeadProposal:
    """The ``budget`` best-scored nodes of a drafted tree, renumbered parents first (ties: earlier first).

    ``parents`` index into the same lists (-1: the root); scores never rise along a path, so the
    kept set is closed under ancestors. Sorting by (depth, rank) keeps parents before children.
    """
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:budget]
    keep = set(order)
    depth = [0] * len(parents)
    for i, p in enumerate(parents):  # parents come before children in a drafted tree
        depth[i] = 0 if p < 0 else depth[p] + 1
    for i in order:  # a tie at the cut could keep a child and drop its parent: keep ancestors
        p = parents[i]
        while p >= 0 and p not in keep:
            keep.add(p)
            p = parents[p]
    ranked = sorted(keep, key=lambda i: (depth[i], -scores[i], i))
    index = {old: new for new, old in enumerate(ranked)}
    return HeadProposal(
        tokens=[tokens[i] for i in ranked],
        parents=[index[parents[i]] if parents[i] >= 0 else -1 for i in ranked],
        scores=[scores[i] for i in ranked],
    )
