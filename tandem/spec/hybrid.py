"""Hybrid proposer: n-gram lookup when the text repeats itself, the draft model otherwise.

A long suffix match (``min_match`` tokens or more) means the sequence is
copying from its prompt or its own output (a summary quoting its source,
code repeating an identifier list); the lookup's continuation is then as good
as a draft model's and costs nothing. Elsewhere the draft model drafts. The
two never disagree about correctness: an n-gram proposal is a point mass,
which the rejection sampler handles exactly like any other q.
"""

from __future__ import annotations

from typing import Hashable

import numpy as np

from tandem.spec.draft_model import DraftModelProposer
from tandem.spec.ngram import lookup_match
from tandem.spec.proposal import Proposal, ProposeRequest


class HybridProposer:
    def __init__(self, draft: DraftModelProposer, min_match: int = 3, max_n: int = 4) -> None:
        if not 1 <= min_match <= max_n:
            raise ValueError(f"hybrid proposer needs 1 <= min_match <= max_n, got {min_match}, {max_n}")
        self.draft = draft
        self.engine = draft.engine  # adaptive k plans with the draft model's cost: the expensive case
        self.min_match, self.max_n = min_match, max_n
        self.name = "hybrid"

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        proposals: list[Proposal | None] = [None] * len(requests)
        for i, r in enumerate(requests):
            if r.k > 0:
                tokens, matched = lookup_match(np.asarray(r.tokens, dtype=np.int64), r.k, self.min_match, self.max_n)
                if matched >= self.min_match and tokens:
                    proposals[i] = Proposal(tokens)
        rest = [i for i, p in enumerate(proposals) if p is None]
        for i, p in zip(rest, self.draft.propose([requests[i] for i in rest])):
            proposals[i] = p
        return proposals  # type: ignore[return-value]

    def release(self, seq_id: Hashable) -> None:
        self.draft.release(seq_id)
