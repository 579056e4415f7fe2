"""Seeded sampled rounds keep exactly plain seeded decoding's tokens, whatever was proposed.

A seeded request's token at position P is the draw ``sample`` makes from the
target's p with the generator seeded at (seed, P) (``SamplingParams.seed_at``):
plain decoding draws it so, and verification draws every row so and keeps the
drafts that equal those draws (``tandem.spec.rejection``, "Seeded sampling").
On the fixed tables of ``test_lossless_wire`` (the real wire encoding, the
real rejection code), every seed's speculative output must equal its plain
output, chain or tree; the law of the first two tokens must be the target's
(chi-square), and a known defect (one noise for every position) must fail it;
and a draft whose q is the target's p, drawing from the same noise as the
draft worker does (``draw_coupled``), must see all its drafts kept.
"""

from __future__ import annotations

import pytest
import torch

from tandem.rpc import distributions
from tandem.sampling import SamplingParams, draw_coupled, probabilities, race_noise, sample
from tandem.spec.rejection import verify, verify_tree
from tandem.spec.tree import ROOT, TokenTree, children_of
from tests.spec.losslessness import SIGNIFICANCE, chi_square_pvalue, one_torch_thread
from tests.spec.test_lossless_wire import DRAFT_SCALE, TARGET_SCALE, VOCAB, FixedModel, exact_law, path_to

SEEDS = range(1000)
TARGET = FixedModel.random(3, TARGET_SCALE)
PARAMS = SamplingParams(temperature=1.0, seed=0)  # the seed is replaced per sample


def plain(target: FixedModel, params: SamplingParams, n: int) -> list[int]:
    """Plain seeded decoding from the empty context: the token at position P drawn with seed_at(P)."""
    generator, out = params.make_generator(), []
    for position in range(n):
        params.seed_at(generator, position)
        out.append(int(sample(probabilities(target.logits(tuple(out))[None], params), generator)[0]))
    return out


def drafted(draft: FixedModel, context: tuple[int, ...], params: SamplingParams, generator: torch.Generator):
    """A seeded draft token after ``context`` as the draft worker draws it, and its wire message."""
    wire = distributions.encode_for_sampling(probabilities(draft.logits(context)[None], params))
    params.seed_at(generator, len(context))
    index = draw_coupled(wire.probs[0], torch.from_numpy(wire.token_ids[0]), VOCAB, generator)
    return int(wire.token_ids[0][index]), wire.messages[0]


def spec_round(target: FixedModel, draft: FixedModel, context: tuple[int, ...], k: int, params: SamplingParams,
               tree: bool) -> list[int]:
    """One round after ``context``: k coupled drafts (a tree adds the draft's next-best token at each depth)."""
    generator = params.make_generator()
    chain, messages = [], []
    for _ in range(k):
        token, message = drafted(draft, (*context, *chain), params, generator)
        chain.append(token)
        messages.append(message)
    nodes = TokenTree()
    nodes.add_path(chain, messages)
    if tree:
        for depth in range(k):
            best = draft.logits((*context, *chain[:depth])).topk(2).indices.tolist()
            leaf = next(t for t in best if t != chain[depth])
            nodes.add_path([leaf], parent=depth - 1 if depth else ROOT)
    q = distributions.decode_distributions(nodes.chain_probs(), VOCAB, nodes.tokens)
    rows = [context, *((*context, *path_to(nodes, node)) for node in range(len(nodes)))]
    logits = torch.stack([target.logits(row) for row in rows])  # [N+1, VOCAB]
    if tree:
        verdict = verify_tree(logits, nodes.tokens, children_of(nodes.parents), q, params, generator,
                              position=len(context))
    else:
        verdict = verify(logits, nodes.tokens, q, params, generator, position=len(context))
    return [*(nodes.tokens[node] for node in verdict.accepted_nodes), verdict.next_token]


def speculative(target: FixedModel, draft: FixedModel, params: SamplingParams, n: int, tree: bool) -> list[int]:
    """Rounds until ``n`` tokens (n <= 2, the tables' depth), each drafting what is still missing."""
    out: list[int] = []
    while len(out) < n:
        out += spec_round(target, draft, tuple(out), n - len(out), params, tree)
    return out[:n]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_every_seed_keeps_its_plain_tokens(tree):
    draft = FixedModel.random(4, DRAFT_SCALE)  # an unrelated draft: many rejections, at every depth
    with one_torch_thread():
        for seed in range(200):
            params = SamplingParams(temperature=1.0, seed=seed)
            assert speculative(TARGET, draft, params, 2, tree) == plain(TARGET, params, 2), seed


@pytest.mark.parametrize("fault,lossless", [(None, True), ("one-noise", False)],
                         ids=["per-position-noise", "one-noise-for-every-position"])
def test_seeded_rounds_follow_the_target(monkeypatch, fault, lossless):
    if fault:
        seed_at = SamplingParams.seed_at
        monkeypatch.setattr(SamplingParams, "seed_at", lambda self, g, position, stream=0: seed_at(self, g, 0, stream))
    draft = FixedModel.random(4, DRAFT_SCALE)
    with one_torch_thread():
        samples = []
        for seed in SEEDS:
            t1, t2 = speculative(TARGET, draft, SamplingParams(temperature=1.0, seed=seed), 2, tree=False)
            samples.append(t1 * VOCAB + t2)
    pvalue = chi_square_pvalue(samples, exact_law(TARGET, PARAMS))
    assert (pvalue > SIGNIFICANCE) == lossless, pvalue


def test_a_draft_with_the_targets_law_is_always_kept():
    """Coupled draws: q = p up to the wire's float16, so the draft draws the target's own token.
    (Drawn from noise of its own, 66 of these 400 drafts were kept.)"""
    kept = drafts = 0
    with one_torch_thread():
        for seed in range(200):
            params = SamplingParams(temperature=1.0, seed=seed)
            out = spec_round(TARGET, TARGET, (), 2, params, tree=False)
            kept += len(out) - 1
            drafts += 2
    assert kept == drafts


def test_the_race_is_how_torch_samples():
    """``sample`` (torch.multinomial) draws argmax(p / race_noise) for the same generator state."""
    for seed in range(20):
        p = torch.softmax(torch.randn(1, 1000, generator=torch.Generator().manual_seed(seed)) * 3, -1)
        drawn = int(sample(p, torch.Generator().manual_seed(seed))[0])
        raced = int((p[0] / race_noise(1000, torch.Generator().manual_seed(seed))).argmax())
        assert drawn == raced
