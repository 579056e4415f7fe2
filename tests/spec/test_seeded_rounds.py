"""Seeded sampled rounds keep exactly plain seeded decoding's tokens, whatever was proposed.

A seeded request's token at position P is the exponential race ``seeded_race``
runs over the target's p, against noise hashed from (seed, P)
(``SamplingParams.noise_key``): plain decoding draws it so, and verification draws every row so and keeps the
drafts that equal those draws (``tandem.spec.rejection``, "Seeded sampling").
On the fixed tables of ``test_lossless_wire`` (the real wire encoding, the
real rejection code), every seed's speculative output must equal its plain
output, chain or tree; the law of the first two tokens must be the target's
(chi-square), and a known defect (one noise for every position) must fail it;
and a draft whose q is the target's p, drawing from the same noise as the
draft worker does (``draw_coupled``), must see all its drafts kept.
"""

from __future__ import annotations

import math

import pytest
import torch

from tandem.rpc import distributions
from tandem.sampling import SamplingParams, draw_coupled, exponential_noise, probabilities, seeded_race
from tandem.spec.rejection import verify, verify_tree
from tandem.spec.tree import ROOT, TokenTree, children_of
from tests.spec.losslessness import SIGNIFICANCE, chi_square_pvalue, one_torch_thread
from tests.spec.test_lossless_wire import DRAFT_SCALE, TARGET_SCALE, VOCAB, FixedModel, exact_law, path_to

SEEDS = range(1000)
TARGET = FixedModel.random(3, TARGET_SCALE)
PARAMS = SamplingParams(temperature=1.0, seed=0)  # the seed is replaced per sample


def plain(target: FixedModel, params: SamplingParams, n: int) -> list[int]:
    """Plain seeded decoding from the empty context, as a target decodes: a Verify of no drafts per token."""
    generator, out = params.make_generator(), []
    for position in range(n):
        verdict = verify(target.logits(tuple(out))[None], [], None, params, generator, position=position)
        out.append(verdict.next_token)
    return out


def drafted(draft: FixedModel, context: tuple[int, ...], params: SamplingParams):
    """A seeded draft token after ``context`` as the draft worker draws it, and its wire message."""
    wire = distributions.encode_for_sampling(probabilities(draft.logits(context)[None], params))
    index = draw_coupled(wire.probs[0], torch.from_numpy(wire.token_ids[0]), params.noise_key(len(context)))
    return int(wire.token_ids[0][index]), wire.messages[0]


def spec_round(target: FixedModel, draft: FixedModel, context: tuple[int, ...], k: int, params: SamplingParams,
               tree: bool) -> list[int]:
    """One round after ``context``: k coupled drafts (a tree adds the draft's next-best token at each depth)."""
    generator = params.make_generator()
    chain, messages = [], []
    for _ in range(k):
        token, message = drafted(draft, (*context, *chain), params)
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
        noise_key = SamplingParams.noise_key
        monkeypatch.setattr(SamplingParams, "noise_key", lambda self, position, stream=0: noise_key(self, 0, stream))
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


def splitmix64_noise(key: int, token_id: int) -> float:
    """The reference: SplitMix64's finaliser in Python's unbounded integers, masked to 64 bits."""
    mask = (1 << 64) - 1
    z = (key + (token_id + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return -math.log(((z >> 11) + 0.5) * 2.0**-53)


def test_the_noise_is_splitmix64_whatever_the_sign_of_its_words():
    """int64 tensors must wrap as uint64 arithmetic does, and ``>>`` must not copy the sign bit in."""
    keys = [0, 1, -1, 2**62 + 12345, -(2**63), SamplingParams(1.0, seed=7).noise_key(41)]
    ids = torch.tensor([[0, 1, 2, 151_935, 2**31 - 1]])
    noise = exponential_noise(torch.tensor(keys), ids)  # [6, 5]
    for r, key in enumerate(keys):
        for c, token in enumerate(ids[0].tolist()):
            assert noise[r, c].item() == pytest.approx(splitmix64_noise(key, token), rel=1e-12)


def test_the_seeded_race_draws_from_p():
    """Over 4,000 keys the race's tokens follow p (chi-square), and each key draws one fixed token."""
    p = torch.softmax(torch.randn(1, 12, generator=torch.Generator().manual_seed(3)) * 2, -1)  # [1, 12]
    keys = torch.arange(4000) * 7919 - 2**40
    drawn = seeded_race(p.expand(4000, 12), keys)
    assert chi_square_pvalue(drawn.tolist(), p[0].numpy()) > SIGNIFICANCE
    assert torch.equal(drawn, seeded_race(p.expand(4000, 12), keys))
    sparse = draw_coupled(p[0, [2, 5, 9]], torch.tensor([2, 5, 9]), int(keys[0]))  # a support's ids alone
    full = int(seeded_race(p.masked_fill(~torch.isin(torch.arange(12), torch.tensor([2, 5, 9])), 0.0), keys[:1]))
    assert [2, 5, 9][sparse] == full  # the noise of an id does not depend on which other ids are drawn


def test_a_small_support_races_its_own_noise_alone_and_draws_the_same_token(monkeypatch):
    """On the CPU a top-p support is raced alone (cheaper); every id's noise is its own, so the token is the
    one the whole row's race draws."""
    import tandem.sampling as sampling

    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(1)) * 4
    p = probabilities(logits, SamplingParams(temperature=0.8, top_p=0.9))  # [6, 5000], a few dozen ids each
    keys = torch.tensor([SamplingParams(1.0, seed=s).noise_key(30 + s) for s in range(6)])
    assert int(torch.count_nonzero(p)) * sampling.SPARSE_RACE_SHARE < p.numel()  # the sparse path runs
    sparse = seeded_race(p, keys)
    monkeypatch.setattr(sampling, "SPARSE_RACE_SHARE", 0)  # every row raced whole
    assert torch.equal(sparse, seeded_race(p, keys))
    assert all(p[r, t] > 0 for r, t in enumerate(sparse.tolist()))
