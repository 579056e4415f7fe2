"""Random-weight checkpoints with real shapes, made on the spot: what a machine without network can check.

``save_random_model`` writes a Hugging Face directory (config.json, model.safetensors,
a tiny tokenizer) of a Qwen2 model with one of ``SHAPES``. The weights are built on
the given device (a 1.5B model initialised on a GPU takes seconds). Embeddings are
drawn with a standard deviation of 1 rather than 0.02, so that logits are spread out
and greedy tokens are not decided by ties: the checks compare greedy outputs.
"""

from __future__ import annotations

from pathlib import Path

import torch

# The shapes of Qwen2.5's configurations (hidden size, layers, heads, KV heads, vocabulary), and tiny ones.
SHAPES: dict[str, dict] = {
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=97, tie_word_embeddings=False),
    "tiny-draft": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=97, tie_word_embeddings=False),
}
COMMON = dict(max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=1,
              eos_token_id=2)


def save_random_model(out_dir: Path, shape: str, device: str, seed: int = 0, **overrides) -> Path:
    """A random Qwen2 checkpoint of ``SHAPES[shape]`` (``overrides`` on top) in ``out_dir``; returns it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    params = {**COMMON, **SHAPES[shape], **overrides}
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**params)).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                p.normal_(0, 1.0)
            elif name.endswith("bias"):  # random init leaves them at 0; make them matter
                p.normal_(0, 0.5)
            elif p.dim() == 2:
                p.normal_(0, 0.02 if params["hidden_size"] >= 512 else 0.2)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    _save_tokenizer(out_dir, params["vocab_size"], params["eos_token_id"], params["bos_token_id"])
    del model
    return out_dir


def _save_tokenizer(out_dir: Path, vocab_size: int, eos: int, bos: int) -> None:
    """The test suite's character-level tokenizer: the coordinator needs one to start."""
    from tests.tiny_models import save_tiny_tokenizer

    save_tiny_tokenizer(out_dir, vocab_size, eos_token_id=eos, bos_token_id=bos)
