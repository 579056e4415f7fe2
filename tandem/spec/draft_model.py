"""Draft-model proposer: a small model (or the target's own first layers) decodes k tokens.

The drafter keeps, per sequence, the tokens whose K/V sit in its cache. Each
round it rolls its cache back to the longest prefix those share with the
committed history (rejected guesses vanish exactly), feeds what is new (the
whole prompt the first time: that is the draft's prefill), then runs k
decode steps. All sequences share each step's forward pass; a sequence whose
k is reached simply leaves the batch.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

from tandem.engine import ForwardItem, ModelEngine
from tandem.sampling import pick_tokens, probabilities, sample
from tandem.spec.proposal import Proposal, ProposeRequest


def common_prefix_len(a: list[int], b: list[int] | tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer:
    """Proposes with a ``ModelEngine`` of its own (its own KV pool)."""

    def __init__(
        self,
        engine: ModelEngine,
        name: str = "draft",
        q_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.engine = engine
        self.name = name
        # A draft worker compresses q for the wire; it must then sample from the compressed q,
        # so the transform is applied before sampling, not after.
        self.q_transform = q_transform
        self._fed: dict[Hashable, list[int]] = {}  # tokens whose K/V are in the draft cache, per sequence

    def sync(self, seq_id: Hashable, tokens: list[int]) -> list[int]:
        """Roll the cache back to what still agrees with ``tokens``; return the tokens to feed next."""
        fed = self._fed.setdefault(seq_id, [])
        # Always feed at least the last token: its logits are where drafting starts.
        keep = min(common_prefix_len(fed, tokens), len(tokens) - 1)
        if keep < len(fed):
            self.engine.rollback(seq_id, keep)
            del fed[keep:]
        return list(tokens[keep:])

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        drafted: list[list[int]] = [[] for _ in requests]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in requests]
        pending = {i: self.sync(r.seq_id, list(r.tokens)) for i, r in enumerate(requests) if r.k > 0}
        while pending:
            order = list(pending)
            items = [ForwardItem(requests[i].seq_id, pending[i], num_logits=1) for i in order]
            logits = self.engine.forward(items)
            for i, row in zip(order, logits):  # row: [1, vocab]
                req = requests[i]
                self._fed[req.seq_id].extend(pending[i])
                if req.sampling.is_greedy:
                    token = int(pick_tokens(row, req.sampling, None)[0])
                else:
                    q = probabilities(row, req.sampling)  # [1, vocab]
                    if self.q_transform is not None:
                        q = self.q_transform(q)
                    token = int(sample(q, req.generator)[0])
                    draft_probs[i].append(q[0])
                drafted[i].append(token)
                if len(drafted[i]) < req.k:
                    pending[i] = [token]
                else:
                    del pending[i]
        return [
            Proposal(tokens, torch.stack(probs) if probs else None)
            for tokens, probs in zip(drafted, draft_probs)
        ]

    def release(self, seq_id: Hashable) -> None:
        if self._fed.pop(seq_id, None) is not None and self.engine.kv_cache.has_sequence(seq_id):
            self.engine.release(seq_id)


def early_exit_proposer(target: ModelEngine, num_layers: int, num_blocks: int | None = None) -> DraftModelProposer:
    """Self-drafting: the target's first ``num_layers`` layers, its final norm and lm_head.

    Shares the target's weights (no extra memory for them) but keeps a KV
    pool of its own for those layers, so drafting never disturbs the
    target's cache.
    """
    total = target.config.num_layers
    if not 0 < num_layers < total:
        raise ValueError(f"early-exit layers must be in 1..{total - 1} for this model, got {num_layers}")
    engine = ModelEngine.with_new_cache(
        target.model,
        num_blocks or target.kv_cache.num_blocks,
        target.kv_cache.block_size,
        target.backend.name,
        num_layers=num_layers,
    )
    return DraftModelProposer(engine, name="early-exit")
