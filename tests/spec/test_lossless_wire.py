"""Speculative sampling through the wire encoding is lossless, on fixed distributions: the statistics in seconds.

A fixed draft and a fixed target over ``VOCAB`` tokens (a table of logits per
context of up to two tokens) stand in for the models, so a sample costs a
fraction of a millisecond and only the wire and the rejection sampler are
under test. Each seeded sample runs a round as the workers do: the draft
encodes each q with ``tandem.rpc.distributions.encode_for_sampling``, draws
its token from what those messages decode to and sends the messages; the
target decodes them with ``decode_distributions`` (point masses included) and
the real rejection sampler decides: ``verify_sampled`` over a k=2 chain, or
``verify_tree`` over that chain plus the draft's next-best token at each of
its positions (deterministic leaves, as the coordinator builds trees). When
the round yields one token, a k=1 round follows. The first two tokens must
follow the target's exact law P(t1) P(t2 | t1) (chi-square).

The companions are the fault injection of ``tests.integration.faulty_draft_worker``
(a real worker process runs the same in ``tests/integration``): its coarse
wire format sent once must pass, its double encoding (the draft samples from
decode(encode(q)) but sends encode(decode(encode(q)))) must fail. The
tables are chosen so that it shows: computed exactly from them, the double
encoding moves the law of (t1, t2) by a chi-square noncentrality of 0.32 per
sample, chain or tree, so ``SAMPLES`` = 1000 give 319 (over 24 degrees of
freedom), which a test at ``SIGNIFICANCE`` misses with probability 6e-32,
whatever the seeds; and a deterministic leaf is kept in 18% of tree
rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from tandem.rpc import distributions
from tandem.sampling import SamplingParams, probabilities, sample
from tandem.spec.rejection import verify_sampled, verify_tree
from tandem.spec.tree import ROOT, TokenTree, children_of
from tandem.v1 import common_pb2
from tests.integration import faulty_draft_worker
from tests.spec.losslessness import SIGNIFICANCE, chi_square_pvalue, one_torch_thread

VOCAB, SAMPLES, TEMPERATURE = 5, 1000, 1.0
DRAFT_STREAM = 0x5EED  # the draft's generator seed offset: its draws are independent of the target's
TARGET_SEED, DRAFT_SEED = 3, 4
# A peaked draft over a flatter target: the draft proposes tokens the target often rejects, so its q
# (and any error in the q the target sees) weighs on the output.
TARGET_SCALE, DRAFT_SCALE = 1.0, 3.5


@dataclass(frozen=True)
class FixedModel:
    """Logits for every context of 0, 1 or 2 tokens: ``levels[d]`` has shape ``[VOCAB] * (d + 1)``."""

    levels: tuple[torch.Tensor, ...]

    @classmethod
    def random(cls, seed: int, scale: float) -> FixedModel:
        """Gaussian logits with standard deviation ``scale``, the same for the same seed."""
        gen = torch.Generator().manual_seed(seed)
        return cls(tuple(torch.randn([VOCAB] * (depth + 1), generator=gen) * scale for depth in range(3)))

    def logits(self, context: tuple[int, ...]) -> torch.Tensor:
        """``[VOCAB]``: the logits of the token after ``context``."""
        return self.levels[len(context)][context]


@dataclass
class WireDraft:
    """The draft worker's side of the wire: q encoded once, each token drawn from what its message decodes to."""

    model: FixedModel
    params: SamplingParams
    # q is a function of the context, and encoding it is deterministic: encode each context once.
    encoded: dict[tuple[int, ...], distributions.WireRows] = field(default_factory=dict)

    def step(self, context: tuple[int, ...], generator: torch.Generator) -> tuple[int, common_pb2.SparseDistribution]:
        """A drafted token after ``context`` and the message of the q it was drawn from."""
        wire = self.encoded.get(context)
        if wire is None:
            q = probabilities(self.model.logits(context)[None], self.params)
            wire = self.encoded[context] = distributions.encode_for_sampling(q)  # looked up: faults patch it
        index = int(sample(wire.probs[0][None], generator)[0])
        return int(wire.token_ids[0][index]), wire.messages[0]

    def next_best(self, context: tuple[int, ...], drafted: int) -> int:
        """The draft's most likely token after ``context`` other than ``drafted`` (a deterministic leaf)."""
        return next(t for t in self.model.logits(context).topk(2).indices.tolist() if t != drafted)


@dataclass
class Seeded:
    """One sample's generators: the target's (its acceptance draws) and the draft's, independent."""

    target: torch.Generator
    draft: torch.Generator

    @classmethod
    def of(cls, seed: int) -> Seeded:
        return cls(torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + DRAFT_STREAM))


def chain_round(target: FixedModel, draft: WireDraft, context: tuple[int, ...], k: int, params: SamplingParams,
                gens: Seeded) -> list[int]:
    """The tokens one round of k sampled drafts after ``context`` yields (accepted, then the target's next)."""
    tokens, messages = [], []
    for _ in range(k):
        token, message = draft.step((*context, *tokens), gens.draft)
        tokens.append(token)
        messages.append(message)
    q = distributions.decode_distributions(messages, VOCAB, tokens)  # as the target decodes a Verify
    logits = torch.stack([target.logits((*context, *tokens[:i])) for i in range(k + 1)])
    verdict = verify_sampled(logits, tokens, q, params, gens.target)
    return [*tokens[: verdict.num_accepted], verdict.next_token]


def tree_round(target: FixedModel, draft: WireDraft, params: SamplingParams, gens: Seeded) -> list[int]:
    """The tokens one tree round from the empty context yields: a sampled k=2 chain, a next-best leaf per depth."""
    chain, messages = [], []
    for _ in range(2):
        token, message = draft.step(tuple(chain), gens.draft)
        chain.append(token)
        messages.append(message)
    tree = TokenTree()
    tree.add_path(chain, messages)
    for depth in range(2):
        tree.add_path([draft.next_best(tuple(chain[:depth]), chain[depth])], parent=depth - 1 if depth else ROOT)
    q = distributions.decode_distributions(tree.chain_probs(), VOCAB, tree.tokens)  # POINT_MASS for the leaves
    logits = torch.stack([target.logits(()), *(target.logits(path_to(tree, node)) for node in range(len(tree)))])
    verdict = verify_tree(logits, tree.tokens, children_of(tree.parents), q, params, gens.target)
    return [*(tree.tokens[node] for node in verdict.accepted_nodes), verdict.next_token]


def path_to(tree: TokenTree, node: int) -> tuple[int, ...]:
    """The tokens from the root down to ``node``, included."""
    path = []
    while node != ROOT:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return tuple(reversed(path))


def first_two_tokens(target: FixedModel, draft: WireDraft, shape: str, params: SamplingParams, seed: int) -> int:
    """``t1 * VOCAB + t2`` of one seeded run: a chain or tree round, then a k=1 round if it yielded one token."""
    gens = Seeded.of(seed)
    if shape == "chain":
        out = chain_round(target, draft, (), 2, params, gens)
    else:
        out = tree_round(target, draft, params, gens)
    if len(out) == 1:
        out += chain_round(target, draft, (out[0],), 1, params, gens)
    return out[0] * VOCAB + out[1]


def exact_law(target: FixedModel, params: SamplingParams) -> np.ndarray:
    """P(t1, t2) of the target alone, flat ``[VOCAB * VOCAB]``."""
    p1 = probabilities(target.logits(())[None], params)[0]
    p2 = probabilities(target.levels[1], params)  # [VOCAB, VOCAB]: row t1 is P(t2 | t1)
    return (p1[:, None] * p2).reshape(-1).double().numpy()


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("fault,lossless", [
    (None, True),  # the real float16 format
    ("coarse", True),  # a coarse format sent once: the draft samples from exactly what the target decodes
    ("double-encoding", False),  # samples from decode(encode(q)), sends encode(decode(encode(q)))
], ids=["float16-wire", "coarse-wire-once", "coarse-wire-double-encoded"])
def test_sampling_through_the_wire_follows_the_target(monkeypatch, shape, fault, lossless):
    if fault:
        faulty_draft_worker.install(monkeypatch.setattr, fault)
    params = SamplingParams(TEMPERATURE)
    target = FixedModel.random(TARGET_SEED, TARGET_SCALE)
    draft = WireDraft(FixedModel.random(DRAFT_SEED, DRAFT_SCALE), params)
    with one_torch_thread():
        samples = [first_two_tokens(target, draft, shape, params, seed) for seed in range(SAMPLES)]
    pvalue = chi_square_pvalue(samples, exact_law(target, params))
    assert (pvalue > SIGNIFICANCE) == lossless, f"p-value {pvalue:.2e}"
