"""Speculation trees in the coordinator's terms: building a tree, choosing its shape, and the
acceptance rule over a tree (greedy cases, and a chi-square test of losslessness that fails for
deliberately broken rules)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.sampling import SamplingParams
from tandem.spec import rejection
from tandem.spec.adaptive import (
    CostModel,
    LoadAwareCost,
    TreeShape,
    choose_tree,
    expected_tokens,
    expected_tree_tokens,
)
from tandem.spec.ngram import lookup_continuations, lookup_match
from tandem.spec.rejection import Verdict, verify_tree
from tandem.spec.tree import POINT_MASS, ROOT, TokenTree, check_parents, children_of, is_chain, kept_on_chain
from tandem.tree_rows import depths
from tests.spec.test_rejection import SIGNIFICANCE, chi_square_pvalue, one_hot_logits

# ----- building trees ---------------------------------------------------------

def test_branches_share_their_common_prefix():
    tree = TokenTree()
    assert tree.add_path([5, 6, 7]) == 3
    assert tree.add_path([5, 6, 9]) == 1  # shares 5, 6
    assert tree.add_path([8]) == 1
    assert tree.tokens == [5, 6, 7, 9, 8]
    assert tree.parents == [ROOT, 0, 1, 1, ROOT]
    assert not tree.is_chain and max(depths(tree.parents)) + 1 == 3
    assert children_of(tree.parents) == {ROOT: [0, 4], 0: [1], 1: [2, 3]}


def test_budget_cuts_a_branch_and_a_chain_stays_a_chain():
    tree = TokenTree()
    tree.add_path([1, 2, 3])
    assert tree.is_chain
    assert tree.add_path([4, 5, 6], budget=5) == 2
    assert len(tree) == 5


def test_sampled_nodes_travel_with_point_masses_for_deterministic_ones():
    q1, q2 = object(), object()
    tree = TokenTree()
    tree.add_path([5, 6], [q1, q2])
    tree.add_path([7], parent=ROOT)
    tree.add_path([5, 9])  # merges into the sampled 5: a deterministic child after the sampled one
    assert tree.parents == [ROOT, 0, ROOT, 0]
    assert tree.chain_probs() == [q1, q2, POINT_MASS, POINT_MASS]
    with pytest.raises(ValueError, match="sampled branch must be inserted first"):
        tree.add_path([7], [q1])


def test_greedy_trees_carry_no_distributions():
    tree = TokenTree()
    tree.add_path([1, 2])
    tree.add_path([3])
    assert tree.chain_probs() == []


@pytest.mark.parametrize("parents,error", [
    ([-1, 0], "2 parents for 3"),
    ([-1, 1, 0], r"parents\[1\] = 1"),
    ([-2, 0, 0], r"parents\[0\] = -2"),
])
def test_bad_parents_are_named(parents, error):
    with pytest.raises(ValueError, match=error):
        check_parents(parents, 3)


def test_kept_on_chain_stops_where_the_path_leaves_the_chain():
    assert kept_on_chain([0, 1, 2], 3) == 3
    assert kept_on_chain([0, 3], 3) == 1  # node 3: a branch beside the chain's second token
    assert kept_on_chain([0, 1, 2], 2) == 2  # node 2 continues below the chain's end: a branch's
    assert kept_on_chain([], 3) == 0


def test_is_chain():
    assert is_chain([]) and is_chain([-1, 0, 1])
    assert not is_chain([-1, 0, 0]) and not is_chain([-1, -1])


def test_ngram_continuations_differ_in_their_first_token():
    history = [1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2]
    found = lookup_continuations(history, 3, 1, 3, limit=3)
    assert found[0] == (lookup_match(history, 3, 1, 3)[0], 2)  # the first is prompt lookup's own
    assert [c[0] for c, _ in found] == [3, 4]  # [1, 2] was followed by 3 (latest) and 4
    assert lookup_continuations(history, 3, 1, 3, limit=0) == []


# ----- choosing the shape -------------------------------------------------------

def test_tree_chosen_when_rows_are_cheap_and_the_chain_often_fails():
    cheap_rows = CostModel(draft_step_s=0.05, verify_base_s=1.0, verify_slope=0.01)
    assert choose_tree(0.5, 0.5, cheap_rows, 4, max_width=2, max_nodes=15) is not None
    costly_rows = CostModel(draft_step_s=0.05, verify_base_s=1.0, verify_slope=0.5)
    assert choose_tree(0.5, 0.5, costly_rows, 4, max_width=2, max_nodes=15) is None
    # a chain that never fails gains nothing from branches
    assert choose_tree(0.999, 0.5, cheap_rows, 4, max_width=2, max_nodes=15) is None
    # no room for extra nodes
    assert choose_tree(0.5, 0.5, cheap_rows, 4, max_width=2, max_nodes=4) is None


def test_tree_rows_are_charged_what_verifications_measured_not_the_workers_prefill_fit():
    """A worker's fit through prompt prefills can make rows look cheap where small batches are compute-bound."""
    def costs(verify_points):
        model = CostModel(draft_step_s=0.05)
        for rows, seconds in verify_points:
            model.observe_verify(rows, seconds)
        return LoadAwareCost(model, streams=1, target_base_s=0.5, target_per_token_s=0.005,
                             draft_base_s=0.05, draft_per_token_s=0.0)

    cheap = costs([(1, 0.505), (3, 0.515), (5, 0.525), (2, 0.51)])
    steep = costs([(1, 0.5), (3, 0.74), (5, 0.98), (2, 0.62)])  # 120 ms a row, as fp32 on a CPU without bf16
    assert choose_tree(0.6, 0.3, cheap, 3, max_width=2, max_nodes=15) is not None
    assert choose_tree(0.6, 0.3, steep, 3, max_width=2, max_nodes=15) is None
    assert steep.round_seconds(3, 2) - steep.round_seconds(3) == pytest.approx(0.24, rel=0.01)


def test_expected_tree_tokens_adds_the_branch_hits():
    shape = TreeShape(depths=1, width=1)
    assert expected_tree_tokens(0.6, 0.0, 3, shape) == expected_tokens(0.6, 3)
    assert expected_tree_tokens(0.6, 1.0, 3, shape) == pytest.approx(expected_tokens(0.6, 3) + 0.4)


# ----- the rule: greedy -------------------------------------------------------------

def test_greedy_tree_follows_the_targets_choices_through_branches():
    # nodes: 0:a=3 (root), 1:b=4 under 0, 2:c=7 (root), 3:d=5 under 0 ; target wants 3, 5, then 6
    tokens, parents = [3, 4, 7, 5], [ROOT, 0, ROOT, 0]
    logits = torch.zeros(5, 10)
    for row, want in enumerate([3, 5, 0, 0, 6]):  # rows: root, node0..node3
        logits[row, want] = 5.0
    verdict = verify_tree(logits, tokens, children_of(parents), None, SamplingParams(), None)
    assert verdict == Verdict(2, 6, [0, 3])


def test_greedy_tree_with_no_match_gives_the_targets_token():
    verdict = verify_tree(one_hot_logits([9, 0, 0]), [1, 2], children_of([ROOT, ROOT]), None, SamplingParams(), None)
    assert verdict == Verdict(0, 9, [])


# ----- the rule: sampling, statistically ---------------------------------------------

VOCAB = 6
_gen = torch.Generator().manual_seed(7)
P = torch.softmax(torch.randn(VOCAB, VOCAB, generator=_gen) * 1.5, -1)  # target: p(next | last), Markov
Q = torch.softmax(torch.randn(VOCAB, VOCAB, generator=_gen) * 1.5, -1)  # draft: q(next | last)
START = 0


def tree_round(last: int, gen: torch.Generator, deterministic_q_from_parent: bool) -> list[int]:
    """One round at context ``last``: a sampled chain of 2 from Q, the draft's next-best at both
    positions and an n-gram-like branch of 2, merged; returns the tokens the rule commits."""
    c1 = int(torch.multinomial(Q[last], 1, generator=gen))
    c2 = int(torch.multinomial(Q[c1], 1, generator=gen))
    tree = TokenTree()
    tree.add_path([c1, c2], [Q[last], Q[c1]])
    for parent, q, drafted in ((ROOT, Q[last], c1), (0, Q[c1], c2)):
        best = [t for t in q.argsort(descending=True).tolist() if t != drafted][0]
        tree.add_path([best], parent=parent)
    tree.add_path([(last + 3) % VOCAB, (last + 4) % VOCAB])
    rows = []
    for node, (token, q) in enumerate(zip(tree.tokens, tree.probs)):
        if q is None:  # a deterministic node: a point mass (or, broken, its parent's q)
            parent = tree.parents[node]
            parent_token = last if parent == ROOT else tree.tokens[parent]
            q = Q[parent_token] if deterministic_q_from_parent else torch.nn.functional.one_hot(
                torch.tensor(token), VOCAB).float()
        rows.append(q)
    logits = torch.log(torch.stack([P[last], *(P[t] for t in tree.tokens)]))  # [N+1, V]
    verdict = verify_tree(logits, tree.tokens, children_of(tree.parents), torch.stack(rows),
                          SamplingParams(temperature=1.0), gen)
    return [*(tree.tokens[n] for n in verdict.accepted_nodes), verdict.next_token]


def first_two_tokens(seed: int, deterministic_q_from_parent: bool = False) -> int:
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while len(out) < 2:
        out += tree_round(out[-1] if out else START, gen, deterministic_q_from_parent)
    return out[0] * VOCAB + out[1]


def exact_two_tokens() -> np.ndarray:
    return (P[START][:, None] * P).reshape(-1).double().numpy()  # P(t1) P(t2 | t1)


@pytest.mark.parametrize("broken,lossless", [
    (None, True),
    ("no-residual", False),
    ("parent-q-for-deterministic", False),
], ids=["correct", "broken-no-residual", "broken-parent-q-for-deterministic"])
def test_tree_rule_output_follows_the_target(monkeypatch, broken, lossless):
    if broken == "no-residual":  # a rejected candidate's mass is not taken out of the residual
        monkeypatch.setattr(rejection, "_without", lambda residual, token, q: residual)
    samples = [first_two_tokens(seed, broken == "parent-q-for-deterministic") for seed in range(3000)]
    pvalue = chi_square_pvalue(samples, exact_two_tokens())
    assert (pvalue > SIGNIFICANCE) == lossless, f"p-value {pvalue:.2e}"
