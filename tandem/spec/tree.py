"""Speculation trees: several guesses per position, merged into one token tree.

A tree is a list of draft nodes in topological order: node ``i`` holds a
token, the index of its parent node (-1: it follows the last committed token,
the root), and, when it was sampled, the distribution q it was drawn from (the
draft's wire message, passed through untouched). A chain is the tree whose
parents are ``-1, 0, 1, ...``; it travels without parents, as before.

Where the branches come from (``tandem.spec.loop`` builds them):
- the draft model's chain, first (sampled or greedy);
- the draft's next-best tokens at the chain's first positions (deterministic
  leaves; the draft reports them with its proposal at no extra step);
- n-gram continuations (the request's own text, the continuation cache), as
  deterministic branches from the root.

Merging is a trie insert: a branch that starts like an existing path shares
its nodes. The order of siblings matters to the sampled acceptance rule
(``tandem.spec.rejection.verify_tree``): a node's sampled child comes before
its deterministic children. Deterministic candidates tried after the sampled
ones, one by one against the residual, only sample that residual exactly,
whatever they are; that is why merging deterministic branches, dropping their
duplicates, or choosing alternatives that depend on the sampled token (the
draft's next-best *other than* the drafted one) keeps the rule lossless.

Plain data, no torch: the coordinator builds trees too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.tree_rows import is_chain, parents_problem
from tandem.v1 import common_pb2

__all__ = ["ROOT", "POINT_MASS", "TokenTree", "check_parents", "children_of", "is_chain", "kept_on_chain"]

ROOT = -1
# The deterministic-node marker among sampled nodes' distributions: an empty message is a point mass
# on the node's own token (tandem.rpc.distributions decodes it so).
POINT_MASS = common_pb2.SparseDistribution()


@dataclass(slots=True)
class TokenTree:
    """Draft nodes in topological order (a parent before its children)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # parent node index, or ROOT
    probs: list[Any] = field(default_factory=list)  # per node: the q it was sampled from, or None (deterministic)
    _children: dict[int, dict[int, int]] = field(default_factory=dict)  # parent -> {token: node}

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return is_chain(self.parents)

    @property
    def sampled(self) -> bool:
        return any(q is not None for q in self.probs)

    def add_path(self, tokens: Sequence[int], probs: Sequence[Any] | None = None, parent: int = ROOT,
                 budget: int | None = None) -> int:
        """Insert a branch below ``parent``, sharing nodes with what is there; returns the nodes added.

        ``probs``: one q per token when the branch was sampled (then it must be inserted before any
        deterministic branch below the same parent: its nodes are new, never merged). ``budget``: the
        most nodes the tree may hold; the branch is cut there.
        """
        added = 0
        for i, token in enumerate(tokens):
            q = probs[i] if probs else None
            siblings = self._children.setdefault(parent, {})
            node = siblings.get(token)
            if node is not None:
                if q is not None:  # its nodes would have to be new: only the first branch may be sampled
                    raise ValueError("a sampled branch must be inserted first below its parent")
                parent = node  # a deterministic token already there (sampled or not): share it
                continue
            if budget is not None and len(self.tokens) >= budget:
                break
            node = len(self.tokens)
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.probs.append(q)
            siblings[token] = node
            parent = node
            added += 1
        return added

    def add_node(self, token: int, parent: int = ROOT) -> int:
        """A deterministic node below ``parent`` (or the one already there with this token): its index."""
        self.add_path([token], parent=parent)
        return self._children[parent][token]

    def chain_probs(self) -> list[Any]:
        """The per-node distributions as the wire carries them: empty when none was sampled,
        else one message per node (``POINT_MASS`` for a deterministic node)."""
        if not self.sampled:
            return []
        return [POINT_MASS if q is None else q for q in self.probs]



def check_parents(parents: Sequence[int], num_nodes: int) -> None:
    """A valid tree: one parent per node, each ``ROOT`` or an earlier node. Raises ValueError naming the node."""
    problem = parents_problem(parents, num_nodes)
    if problem is not None:
        raise ValueError(f"draft_parents: {problem}")


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """parent -> its children, in node order (the order the acceptance rule tries them)."""
    children: dict[int, list[int]] = {}
    for node, p in enumerate(parents):
        children.setdefault(p, []).append(node)
    return children


def kept_on_chain(kept: Sequence[int], chain_len: int) -> int:
    """How many of the kept nodes (root to leaf) are the chain's: the tree's first branch, nodes
    ``0..chain_len-1``. A chain's kept nodes are all of them; a branch may also go on below the
    chain's last node, and those nodes are not the chain's."""
    along = 0
    while along < min(len(kept), chain_len) and kept[along] == along:
        along += 1
    return along
