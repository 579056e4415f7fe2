"""Medusa heads: K small heads on the target's final hidden state, head k guessing the token k + 1 after ``b``.

Each head is residual blocks (``x + silu(W x + c)``, the Medusa paper's block,
zero-initialised so that an untrained head starts as the target's own lm_head)
followed by an lm_head over the draft vocabulary. Tandem's own heads share one
lm_head (K copies of a 151k-token head would cost more memory than the issue
allows); the Medusa project's published heads have one each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.heads.config import HeadsConfig


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # identity at the start: the head begins as the base model's head

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, hidden]
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """``forward(hidden [R, H]) -> [R, K, draft_vocab]`` float32 logits; ``d2t`` maps draft ids to target ids."""

    def __init__(self, cfg: HeadsConfig) -> None:
        super().__init__()
        if cfg.kind != "medusa":
            raise ValueError(f"MedusaHeads needs a medusa config, got {cfg.kind!r}")
        self.config = cfg
        hidden, vocab = cfg.hidden_size, cfg.draft_vocab_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden) for _ in range(cfg.num_res_layers))) for _ in range(cfg.num_heads)
        )
        if cfg.shared_lm_head:
            self.lm_head = nn.Linear(hidden, vocab, bias=False)
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(hidden, vocab, bias=False) for _ in range(cfg.num_heads))
        # draft id -> target id ([draft_vocab] int64); the identity when the draft vocabulary is the target's
        self.register_buffer("d2t", torch.arange(vocab, dtype=torch.int64))

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def head_states(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, K, H]
        return torch.stack([block(hidden) for block in self.blocks], dim=1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, K, draft_vocab] float32
        states = self.head_states(hidden)  # [R, K, H]
        if self.config.shared_lm_head:
            return self.lm_head(states).float()
        return torch.stack([head(states[:, k]) for k, head in enumerate(self.lm_heads)], dim=1).float()
