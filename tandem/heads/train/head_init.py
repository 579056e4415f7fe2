"""Fresh heads for a target, started where the target already is rather than from noise.

- ``lm_head``: the target's own lm_head rows of the draft vocabulary (Medusa's start:
  an untrained Medusa head is then the target's head on its own state; for EAGLE it is a
  head that already reads the target's hidden space).
- Medusa's residual blocks start as the identity (``tandem.heads.medusa``).
- EAGLE's ``fc`` starts as the identity on the highest stream it reads (the layer nearest
  the output, whose state the lm_head already half understands) plus the usual small
  random weights on the others, scaled down so that they start as a correction; the
  layer's two output projections (``o_proj``, ``down_proj``) start at zero, so the untrained
  layer passes its hidden state through and training grows each branch from nothing
  (the zero-initialised residual branch of Fixup/ReZero, as Medusa's blocks do).

Built in float32 (the master weights; autocast decides the compute dtype), with the seed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.config import ModelConfig
from tandem.heads.config import HeadsConfig
from tandem.heads.store import Heads, build_heads
from tandem.models.tensor_parallel import Shard
from tandem.models.weights import Checkpoint

_OTHER_STREAMS_SCALE = 0.1


def target_lm_head_rows(model_dir: Path, target: ModelConfig, d2t: torch.Tensor) -> torch.Tensor:
    """The target's lm_head rows ``[draft, H]`` float32 of the ids ``d2t``, read from its checkpoint
    (a loaded engine may hold only oneDNN's packed copy of its lm_head)."""
    name = "model.embed_tokens.weight" if target.tie_word_embeddings else "lm_head.weight"
    checkpoint = Checkpoint(model_dir)
    if name not in checkpoint and "lm_head.weight" in checkpoint:
        name = "lm_head.weight"
    full = checkpoint.read(name, None, Shard(), torch.float32, torch.device("cpu"))  # [vocab, H]
    return full[d2t]


def initial_heads(cfg: HeadsConfig, lm_head_rows: torch.Tensor, d2t: torch.Tensor, seed: int,
                  device: torch.device) -> Heads:
    """``lm_head_rows`` ``[draft, H]``: the target's rows of the ids ``d2t`` (``target_lm_head_rows``)."""
    torch.manual_seed(seed)
    heads = build_heads(cfg)
    with torch.no_grad():
        heads.d2t.copy_(d2t)
        rows = lm_head_rows
        for head in ([heads.lm_head] if cfg.kind == "eagle" or cfg.shared_lm_head else list(heads.lm_heads)):
            head.weight.copy_(rows)
        if cfg.kind == "eagle":
            fc = heads.fc.weight  # [H, streams * H]
            fc.mul_(_OTHER_STREAMS_SCALE)
            top = fc[:, -cfg.hidden_size:]
            top.zero_()
            top.diagonal().fill_(1.0)
            torch.nn.init.zeros_(heads.layer.self_attn.o_proj.weight)
            torch.nn.init.zeros_(heads.layer.mlp.down_proj.weight)
    return heads.to(device).train()
