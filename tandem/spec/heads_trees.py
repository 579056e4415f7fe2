"""The coordinator's side of a heads round: how many nodes to ask for, and the tree a round verifies.

The target's heads (tandem/heads, on the target worker) answer each Prefill and Verify
with a token tree for the next round. Here, torch-free: the node budget asked for, the
reply's tree as a proposal, and that proposal cut to the room left with the request's
own n-gram continuation added as a branch.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.spec.adaptive import MAX_K
from tandem.spec.options import SpecOptions
from tandem.spec.proposers import HEADS, Proposal
from tandem.spec.request import RequestState
from tandem.spec.transport import FittedCost, TreeProposal
from tandem.spec.tree import ROOT, TokenTree

# Heads' tree size when the options leave it to the cost: as many nodes as verification prices at
# HEADS_EXTRA_COST of a one-token step (MODELS.md: ~16 nodes cost ~1.2x a step on a CPU in bf16).
HEADS_EXTRA_COST = 0.25
HEADS_DEFAULT_NODES = 8  # before the target's forward cost has been fitted


def heads_budget(options: SpecOptions, state: RequestState, max_context: int, fit: FittedCost | None,
                 first: bool = False) -> int:
    """Nodes to ask the heads for (0: no heads). Given, or as many as verification prices at
    ``HEADS_EXTRA_COST`` of a one-token step by the target's fitted forward cost (``fit``). ``first``: a
    Prefill's (a rebuild's too), at least one: the heads' KV is built along with the target's."""
    if not options.uses_heads:
        return 0
    nodes = options.heads_nodes or HEADS_DEFAULT_NODES
    if not options.heads_nodes and fit is not None:
        # A heads loop's trees are all one size, so the fit soon cannot tell its slope any more: the last one stands.
        base, per_token = ((fit.last_base_s, fit.last_per_token_s) if fit.last_per_token_s > 0
                           else (fit.base_s, fit.per_token_s))
        if per_token > 0:
            nodes = int(HEADS_EXTRA_COST * (base + per_token) / per_token)
    room = min(max_context - len(state.history) - 2, state.remaining - 2)
    return max(1 if first else 0, min(nodes, MAX_K, room))


def add_tree(into: TokenTree, tokens: Sequence[int], parents: Sequence[int], budget: int) -> None:
    """Add a tree's nodes (parents first) as deterministic nodes, within ``budget`` nodes in all:
    a node whose parent did not fit is left out, so what is added is still a tree."""
    node_of: dict[int, int] = {ROOT: ROOT}
    for node, (token, parent) in enumerate(zip(tokens, parents)):
        if len(into) < budget and parent in node_of:
            node_of[node] = into.add_node(token, node_of[parent])


def heads_proposal(tree: TreeProposal | None, base_len: int) -> Proposal | None:
    """The tree of a reply, as the proposal for the history of ``base_len`` tokens it was drafted after."""
    if tree is None or not tree.tokens:
        return None
    proposal = Proposal(base_len, list(tree.tokens), source=HEADS, tree=TokenTree())
    add_tree(proposal.tree, tree.tokens, tree.parents, MAX_K)  # chosen, not sampled: deterministic nodes
    return proposal


def round_tree(ready: Proposal | None, room: int, repeat: Sequence[int]) -> TokenTree | None:
    """This round's tree: the heads' proposal (``ready``, None when it no longer fits the history) cut to
    ``room`` nodes, and ``repeat`` (the request's own n-gram continuation, or nothing) as a branch."""
    if room <= 0:
        return None
    tree = TokenTree()
    if ready is not None and ready.tree is not None:
        add_tree(tree, ready.tree.tokens, ready.tree.parents, room)
    if repeat:
        tree.add_path(repeat, budget=room)
    return tree if len(tree) else None
