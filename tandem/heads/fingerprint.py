"""Which target a set of heads belongs to: a hash of the target's shape and a sample of its weights.

Heads learn one target's hidden states; served on another (even one of the same shape)
they propose nonsense. The fingerprint reads only tensors every tensor-parallel rank
holds whole (the embedding and the final norm), rounded to bf16 so that a target loaded
in fp32 or bf16 has the same one.
"""

from __future__ import annotations

import hashlib
import json

import torch

from tandem.models import CausalLM

SAMPLED_ROWS = 64  # embedding rows hashed, spread over the vocabulary


def target_fingerprint(model: CausalLM) -> str:
    cfg = model.config
    shape = {name: getattr(cfg, name) for name in (
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
        "head_dim")}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode())
    embed = model.embed_tokens.weight
    step = max(1, embed.shape[0] // SAMPLED_ROWS)
    for tensor in (embed[::step][:SAMPLED_ROWS], model.norm.weight):
        digest.update(tensor.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()
