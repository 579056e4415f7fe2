"""The coordinator's side of heads rounds: the node budget asked for, and the tree a round verifies."""

from __future__ import annotations

from tandem.sampling_params import SamplingParams
from tandem.spec.heads_trees import heads_budget, heads_proposal, round_tree
from tandem.spec.options import SpecOptions
from tandem.spec.request import RequestState, StopConditions
from tandem.spec.transport import FittedCost, TreeProposal


def state(generated: int = 0, limit: int = 100) -> RequestState:
    s = RequestState([1, 2, 3], SamplingParams(), StopConditions(limit))
    s.commit([4] * generated)
    return s


def test_budget_follows_the_verification_cost_the_options_and_the_room():
    eagle = SpecOptions("eagle", 4)
    assert heads_budget(SpecOptions("ngram", 4), state(), 1000, None) == 0  # not a heads request
    assert heads_budget(eagle, state(), 1000, None) == 8  # before any fit: the default
    # a CPU: rows nearly free until ~a quarter of a step (base 170 ms, 3 ms a row: 14 nodes)
    assert heads_budget(eagle, state(), 1000, FittedCost(0.170, 0.003)) == 14
    assert heads_budget(eagle, state(), 1000, FittedCost(0.010, 0.010)) == 0  # rows as dear as the step
    assert heads_budget(eagle, state(), 1000, FittedCost(0.010, 0.010), first=True) == 1  # a Prefill: >= 1
    assert heads_budget(SpecOptions("eagle", 4, heads_nodes=5), state(), 1000, FittedCost(0.17, 0.003)) == 5
    # Trees of one size: the current slope is unknown (0), the last one prices the nodes (not the 8-node fallback).
    assert heads_budget(eagle, state(), 1000, FittedCost(0.095, 0.0, 0.05, 0.005)) == 2
    assert heads_budget(eagle, state(), 1000, FittedCost(0.095, 0.0)) == 8
    assert heads_budget(eagle, state(generated=95), 1000, None) == 3  # 5 tokens left: at most 3 nodes
    assert heads_budget(eagle, state(), 10, None) == 5  # the context: 10 - 3 history - 2


def test_a_round_tree_is_the_proposal_cut_to_the_room_plus_the_repeat():
    proposal = heads_proposal(TreeProposal([10, 11, 12, 13, 14], [-1, -1, 0, 2, 1]), base_len=7)
    assert proposal is not None and proposal.base_len == 7 and proposal.source == "heads"
    assert proposal.tree.tokens == [10, 11, 12, 13, 14] and proposal.tree.parents == [-1, -1, 0, 2, 1]
    assert not proposal.tree.sampled  # chosen, not sampled: point masses for the acceptance rule
    cut = round_tree(proposal, room=3, repeat=[])
    assert cut.tokens == [10, 11, 12] and cut.parents == [-1, -1, 0]  # node 3's parent 12 fits, node 3 does not
    merged = round_tree(proposal, room=15, repeat=[10, 12, 99])  # shares 10 -> 12, then a new leaf
    assert merged.tokens == [10, 11, 12, 13, 14, 99] and merged.parents[-1] == 2
    assert round_tree(None, room=4, repeat=[5, 6]).tokens == [5, 6]
    assert round_tree(None, room=4, repeat=[]) is None and round_tree(proposal, room=0, repeat=[1]) is None
    assert heads_proposal(TreeProposal([], []), 3) is None and heads_proposal(None, 3) is None
