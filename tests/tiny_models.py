"""Tiny random-weight checkpoints in the Hugging Face layout, made by transformers itself."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


def save_tiny_model(out_dir: Path, family: str, seed: int = 0, **overrides) -> Path:
    """Write config.json + model.safetensors of a random Llama or Qwen2 model; returns ``out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    params = {**TINY_COMMON, **overrides}
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **params))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **params))
        with torch.no_grad():  # random init leaves biases at 0; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        raise ValueError(family)
    with torch.no_grad():  # larger weights than the default init, so that logits are not near-uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(out_dir)
    return out_dir
