"""Small heads for tiny targets, for tests: random layers, the target's own lm_head rows, its fingerprint."""

from __future__ import annotations

import torch

from tandem.engine import FINAL, ModelEngine
from tandem.heads.config import HeadsConfig
from tandem.heads.fingerprint import target_fingerprint
from tandem.heads.store import Heads, build_heads


def tiny_heads_config(target: ModelEngine, kind: str, **overrides) -> HeadsConfig:
    cfg = target.config
    layers = cfg.num_layers
    values = dict(
        kind=kind, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, draft_vocab_size=cfg.vocab_size,
        target_fingerprint=target_fingerprint(target.model), target_name="tiny",
    )
    if kind == "medusa":
        values.update(feature_streams=(FINAL,), num_heads=3)
    else:
        values.update(feature_streams=(min(2, layers), layers // 2, max(0, layers - 3)),
                      num_attention_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                      intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.rms_norm_eps,
                      rope_theta=cfg.rope_theta)
    values.update(overrides)
    return HeadsConfig(**values)


def tiny_heads(target: ModelEngine, kind: str, seed: int = 0, **overrides) -> Heads:
    """Random heads whose lm_head is the target's (so an untrained Medusa head repeats the target's next token)."""
    torch.manual_seed(seed)
    heads = build_heads(tiny_heads_config(target, kind, **overrides))
    with torch.inference_mode():  # the target's lm_head, however it is stored (packed or not): logits of I
        eye = torch.eye(target.config.hidden_size, dtype=target.dtype, device=target.device)
        lm_head = target.model.logits(eye).T.clone()  # [vocab, hidden]
    with torch.no_grad():
        heads.lm_head.weight.copy_(lm_head)
        if kind == "eagle":
            for p in heads.layer.parameters():
                if p.dim() > 1:
                    p.mul_(0.1)  # small weights: the layer's output stays near its input
    return heads.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)  # (gpu_check: on CUDA)
