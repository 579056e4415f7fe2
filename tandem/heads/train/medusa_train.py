"""What Medusa heads are asked on a batch: head ``k`` at row ``t`` guesses the target's label ``y_{t+k+1}``.

Row ``t``'s final hidden state gave the target's next token ``y_t`` (the token ``b``
serving appends); head ``k`` (0-based) guesses the token ``k + 1`` places after ``b``,
which is what the target itself says ``k + 1`` positions later: ``y_{t+k+1}``. A row
counts only where that label exists (``t + k + 1`` inside the sequence) and is not
``NO_LABEL`` (a prompt's position in a conversation: the heads learn the answers).
"""

from __future__ import annotations

import torch

from tandem.heads.medusa import MedusaHeads
from tandem.heads.train.shards import Batch
from tandem.heads.train.vocab import draft_labels

Prediction = tuple[torch.Tensor, torch.Tensor]  # logits [R, draft_vocab] float32, draft labels [R] int64


class MedusaObjective:
    def __init__(self, heads: MedusaHeads, t2d: torch.Tensor) -> None:
        self.heads = heads
        self.t2d = t2d  # [vocab] int64, -1: not in the draft vocabulary
        self.names = [f"head {k + 1}" for k in range(heads.num_heads)]

    def predictions(self, batch: Batch) -> list[Prediction]:
        heads = self.heads
        hidden = batch.features.float()  # [B, N, H]: the final normed state
        num_tokens = batch.tokens.shape[1]
        positions = torch.arange(num_tokens, device=hidden.device)  # [N]
        out: list[Prediction] = []
        for k, block in enumerate(heads.blocks):
            ahead = k + 1
            labels = torch.nn.functional.pad(batch.labels[:, ahead:], (0, ahead), value=0)  # [B, N]: y_{t+k+1}
            # A row counts where its label exists and is one to learn (not a prompt's: see corpus.learn_from).
            rows = (positions[None, :] + ahead < batch.lengths[:, None]) & (labels >= 0)  # [B, N]
            states = block(hidden[rows])  # [R, H]
            head = heads.lm_head if heads.config.shared_lm_head else heads.lm_heads[k]
            out.append((head(states).float(), draft_labels(labels[rows], self.t2d)))
        return out
