"""The draft vocabulary: the target ids the heads score, chosen by how often the target says them.

The ``size`` ids most frequent as the target's labels in the training data (ties: more
frequent as input tokens, then the lower id), sorted by id. ``d2t`` maps a draft id to
its target id (absolute, as Tandem stores it); ``t2d`` the other way, -1 where a target
id has no draft id: a label the heads cannot say, ignored by the loss, a miss in accuracy.
"""

from __future__ import annotations

import torch

OUT_OF_VOCAB = -100  # F.cross_entropy's ignore_index: a label outside the draft vocabulary


def draft_vocabulary(label_counts: torch.Tensor, token_counts: torch.Tensor, size: int) -> torch.Tensor:
    """``d2t`` ``[size]`` int64, ascending target ids, from per-id counts ``[vocab]``."""
    vocab = label_counts.numel()
    if size >= vocab:
        return torch.arange(vocab, dtype=torch.int64)
    # One sortable key: label count first, input count second; a stable sort keeps lower ids first on ties.
    key = label_counts.double() * (token_counts.max().double() + 1) + token_counts.double()
    chosen = torch.sort(-key, stable=True).indices[:size]
    return torch.sort(chosen).values


def target_to_draft(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [vocab] int64, -1: none
    t2d = torch.full((vocab_size,), -1, dtype=torch.int64, device=d2t.device)
    t2d[d2t] = torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device)
    return t2d


def draft_labels(labels: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Target-id labels (>= 0) as draft ids, ``OUT_OF_VOCAB`` where the draft vocabulary lacks them."""
    draft = t2d[labels]
    return torch.where(draft >= 0, draft, torch.full_like(draft, OUT_OF_VOCAB))


def coverage(label_counts: torch.Tensor, d2t: torch.Tensor) -> float:
    """The share of the training labels the draft vocabulary can say."""
    total = int(label_counts.sum())
    return float(label_counts[d2t].sum()) / total if total else 0.0
