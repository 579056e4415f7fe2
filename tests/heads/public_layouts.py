"""Tiny random heads written in the public layouts, the way the projects that publish them write them.

- Medusa (github FasterDecoding/Medusa): ``medusa_head`` is a ModuleList of
  ``Sequential(ResBlock x L, Linear(hidden, vocab, bias=False))`` whose L blocks are one module
  repeated; training saves its state dict with safetensors' ``save_file`` as
  ``medusa_lm_head.safetensors``, its loaders read ``medusa_lm_head.pt`` (``torch.save``), and
  ``MedusaConfig.save_pretrained`` writes ``config.json``.
- EAGLE-3 in vLLM's speculators layout: ``config.json`` with ``speculators_model_type: "eagle3"``
  and the layer's transformers config, ``model.safetensors`` with ``layers.0.*``; or in the
  EAGLE-3 authors' layout: a Llama ``config.json`` with ``draft_vocab_size`` and
  ``midlayer.*`` tensors in ``pytorch_model.bin``. ``d2t`` holds offsets (target id = draft
  id + d2t), ``t2d`` marks the target ids the draft vocabulary keeps.

Test helpers only: Tandem never writes these layouts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

TARGET_NAME = "example-org/tiny-target"


# ----- Medusa ---------------------------------------------------------------------------------------------------
class MedusaResBlock(nn.Module):
    """The Medusa project's block (``x + SiLU(linear(x))``): its attribute names are the file's tensor names."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def medusa_head_module(num_heads: int, num_layers: int, hidden: int, vocab: int, seed: int = 0) -> nn.ModuleList:
    """Random heads built as the project builds ``medusa_head`` (a head's blocks are ONE module repeated)."""
    torch.manual_seed(seed)
    heads = nn.ModuleList(
        nn.Sequential(*([MedusaResBlock(hidden)] * num_layers), nn.Linear(hidden, vocab, bias=False))
        for _ in range(num_heads)
    )
    with torch.no_grad():  # the project zero-initialises the blocks; random ones make every tensor matter
        for p in heads.parameters():
            p.normal_(0, 0.3)
    return heads.requires_grad_(False)


def write_medusa(directory: Path, state: dict[str, torch.Tensor], *, num_heads: int, num_layers: int,
                 weights: str = "safetensors", base_model: str = TARGET_NAME,
                 config: dict[str, Any] | None = None) -> Path:
    """``config.json`` + ``medusa_lm_head.safetensors`` (``weights="safetensors"``) or ``medusa_lm_head.pt``.

    ``state``: ``medusa_head.state_dict()`` (``config`` overrides fields of the written config)."""
    directory.mkdir(parents=True, exist_ok=True)
    if weights == "safetensors":
        save_file(dict(state), str(directory / "medusa_lm_head.safetensors"))
    else:
        torch.save(state, directory / "medusa_lm_head.pt")
    medusa_config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
                     "base_model_name_or_path": base_model, "version": "2", "transformers_version": "4.34.0"}
    (directory / "config.json").write_text(json.dumps({**medusa_config, **(config or {})}, indent=2))
    return directory


# ----- EAGLE-3 --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EagleShape:
    hidden: int = 64  # the tiny target's (tests/tiny_models.py TINY_COMMON)
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 96
    vocab: int = 97
    draft_vocab: int = 40
    num_streams: int = 3


def eagle3_public_tensors(shape: EagleShape, seed: int = 0,
                          attention_bias: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random EAGLE-3 tensors under the speculators names, and the target ids of the draft vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    h, q_rows, kv_rows = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen) * 0.3

    draft_ids = torch.randperm(shape.vocab, generator=gen)[: shape.draft_vocab].sort().values  # [draft_vocab]
    t2d = torch.zeros(shape.vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors = {
        "embed_tokens.weight": rand(shape.vocab, h),  # speculators saves its copy of the target's embedding
        "fc.weight": rand(h, shape.num_streams * h),
        "layers.0.input_layernorm.weight": 1 + rand(h),
        "layers.0.hidden_norm.weight": 1 + rand(h),
        "layers.0.self_attn.q_proj.weight": rand(q_rows, 2 * h),
        "layers.0.self_attn.k_proj.weight": rand(kv_rows, 2 * h),
        "layers.0.self_attn.v_proj.weight": rand(kv_rows, 2 * h),
        "layers.0.self_attn.o_proj.weight": rand(h, q_rows),
        "layers.0.post_attention_layernorm.weight": 1 + rand(h),
        "layers.0.mlp.gate_proj.weight": rand(shape.intermediate, h),
        "layers.0.mlp.up_proj.weight": rand(shape.intermediate, h),
        "layers.0.mlp.down_proj.weight": rand(h, shape.intermediate),
        "norm.weight": 1 + rand(h),
        "lm_head.weight": rand(shape.draft_vocab, h),
        "d2t": draft_ids - torch.arange(shape.draft_vocab),  # offsets, as EAGLE-3 and speculators store them
        "t2d": t2d,
    }
    if attention_bias:
        for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            tensors[f"layers.0.self_attn.{name}_proj.bias"] = rand(rows)
    return tensors, draft_ids


def layer_config(shape: EagleShape, **overrides: Any) -> dict[str, Any]:
    """The draft layer's transformers config as the installed transformers serialises it (``to_diff_dict``)."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=1,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        rms_norm_eps=1e-5, max_position_embeddings=2048, tie_word_embeddings=False,
    )
    return LlamaConfig(**{**fields, **overrides}).to_diff_dict()


def write_speculators_eagle3(directory: Path, tensors: dict[str, torch.Tensor], shape: EagleShape, *,
                             aux_layer_ids: list[int] | None, verifier: str = TARGET_NAME,
                             layer_overrides: dict[str, Any] | None = None, **fields: Any) -> Path:
    """``config.json`` + ``model.safetensors`` as speculators' ``save_pretrained`` writes an Eagle3 draft model."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    config = {
        "architectures": ["Eagle3Speculator"], "dtype": "float32", "transformers_version": "5.0.0",
        "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": layer_config(shape, **(layer_overrides or {})),
        "draft_vocab_size": shape.draft_vocab, "norm_before_residual": False, "target_hidden_size": shape.hidden,
        "eagle_aux_hidden_state_layer_ids": aux_layer_ids, "norm_before_fc": False, "fc_norm": False,
        "norm_output": False, "embed_requires_grad": False,
    }
    (directory / "config.json").write_text(json.dumps({**config, **fields}, indent=2))
    return directory


def write_eagle3_authors(directory: Path, tensors: dict[str, torch.Tensor], shape: EagleShape, *,
                         aux_layer_ids: list[int] | None = None) -> Path:
    """The EAGLE-3 authors' layout: a Llama config.json with ``draft_vocab_size``; ``midlayer.*`` in
    pytorch_model.bin."""
    directory.mkdir(parents=True, exist_ok=True)
    renamed = {name.replace("layers.0.", "midlayer.", 1): t for name, t in tensors.items()}
    torch.save(renamed, directory / "pytorch_model.bin")
    config = {**layer_config(shape), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": shape.draft_vocab}
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids, "use_aux_hidden_state": True}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
