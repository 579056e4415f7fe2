"""Heads as the Medusa project publishes them (github FasterDecoding/Medusa), under ``MedusaHeads``' names.

What that project writes (``medusa/train/train_legacy.py``, ``medusa/model/medusa_model.py``):

- ``config.json``: its ``MedusaConfig`` (``medusa_num_heads``, ``medusa_num_layers``,
  ``base_model_name_or_path``: the target), without the hidden size or the vocabulary.
- ``medusa_lm_head.safetensors`` (what training saves) or ``medusa_lm_head.pt`` (``torch.save``,
  what its loaders read): the state dict of ``medusa_head``, one
  ``Sequential(ResBlock x L, Linear(hidden, vocab, bias=False))`` per head ``k``:
  ``{k}.{l}.linear.weight`` [H, H] and ``{k}.{l}.linear.bias`` [H] for each block ``l < L``,
  then ``{k}.{L}.weight`` [vocab, H], the head's own lm_head over the whole vocabulary.
  The project builds a head's blocks as one module repeated (``[ResBlock(h)] * L``), so
  with L > 1 their tensors are equal; Tandem keeps a copy per block.

The head count is the weights': the project's own uploaded configs under-report it
(its loader overrides the config and loads the weights non-strictly), so a config that
names fewer heads than the weights hold is not believed; one that names more is an error.
Medusa heads hold no fingerprint of their target: ``HeadsConfig.check_target`` can only
compare the hidden size and vocabulary with the target's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from tandem.heads.config import FINAL_STREAM, HeadsConfig, HeadsConfigError
from tandem.heads.formats import check_shape, load_weights

WEIGHTS_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
_KEY = re.compile(r"(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")  # head . module-in-Sequential . tensor


def is_medusa_layout(directory: Path, config: dict[str, Any] | None) -> bool:
    return any((directory / name).is_file() for name in WEIGHTS_FILES) or bool(config and "medusa_num_heads" in config)


def read_medusa(directory: Path, config: dict[str, Any] | None) -> tuple[HeadsConfig, dict[str, torch.Tensor]]:
    where = f"Medusa heads {directory}"
    if config is None:
        raise HeadsConfigError(f"{where}: no config.json (the Medusa project writes its MedusaConfig beside the "
                               "weights: medusa_num_heads, medusa_num_layers, base_model_name_or_path)")
    if not any((directory / name).is_file() for name in WEIGHTS_FILES):
        raise HeadsConfigError(
            f"{where}: no weights file, expected {' or '.join(WEIGHTS_FILES)} (a Medusa-2 checkpoint that holds "
            "the whole target with its heads is not a heads directory: Tandem reads the heads file alone)"
        )
    weights_path, public = load_weights(directory, WEIGHTS_FILES, "Medusa heads")
    where = f"Medusa heads {weights_path}"
    num_heads, num_layers = _head_structure(public, where)
    _check_config(config, num_heads, num_layers, where)

    vocab, hidden = public[f"0.{num_layers}.weight"].shape
    state: dict[str, torch.Tensor] = {}
    for k in range(num_heads):
        for layer in range(num_layers):
            block = f"blocks.{k}.{layer}.linear"
            state[f"{block}.weight"] = check_shape(public, f"{k}.{layer}.linear.weight", (hidden, hidden), where)
            state[f"{block}.bias"] = check_shape(public, f"{k}.{layer}.linear.bias", (hidden,), where)
        state[f"lm_heads.{k}.weight"] = check_shape(public, f"{k}.{num_layers}.weight", (vocab, hidden), where)
    state["d2t"] = torch.arange(vocab, dtype=torch.int64)  # every head scores the whole vocabulary

    cfg = HeadsConfig(
        kind="medusa", layout="medusa", hidden_size=hidden, vocab_size=vocab, draft_vocab_size=vocab,
        feature_streams=(FINAL_STREAM,), num_heads=num_heads, num_res_layers=num_layers, shared_lm_head=False,
        target_name=str(config.get("base_model_name_or_path") or ""), target_fingerprint="",
    )
    return cfg, state


def _head_structure(public: dict[str, torch.Tensor], where: str) -> tuple[int, int]:
    """``(num_heads, blocks per head)`` from the tensor names; every name must fit the project's layout."""
    unexpected = sorted(name for name in public if not _KEY.fullmatch(name))
    if unexpected:
        raise HeadsConfigError(f"{where}: tensors outside the Medusa layout ({{head}}.{{block}}.linear.weight|bias, "
                               f"{{head}}.{{L}}.weight): {unexpected[:6]}")
    heads: dict[int, set[int]] = {}  # head -> index of its lm_head in the Sequential (== its block count)
    for name in public:
        k, index, tensor = _KEY.fullmatch(name).groups()  # type: ignore[union-attr]
        heads.setdefault(int(k), set())
        if tensor == "weight":
            heads[int(k)].add(int(index))
    if not heads:
        raise HeadsConfigError(f"{where}: no tensors")
    if sorted(heads) != list(range(len(heads))):
        raise HeadsConfigError(f"{where}: heads {sorted(heads)} are not numbered 0..{len(heads) - 1}")
    for k, lm_heads in sorted(heads.items()):
        if len(lm_heads) != 1:
            raise HeadsConfigError(f"{where}: head {k} has {len(lm_heads)} lm_head tensors ({{k}}.{{L}}.weight): "
                                   f"{sorted(lm_heads)}")
    layer_counts = {k: next(iter(lm_heads)) for k, lm_heads in heads.items()}
    if len(set(layer_counts.values())) != 1:
        raise HeadsConfigError(f"{where}: heads have different block counts {layer_counts}")
    return len(heads), layer_counts[0]


def _check_config(config: dict[str, Any], num_heads: int, num_layers: int, where: str) -> None:
    said_layers = config.get("medusa_num_layers")
    if said_layers is not None and int(said_layers) != num_layers:
        raise HeadsConfigError(f"{where}: config.json says medusa_num_layers {said_layers}, the weights hold "
                               f"{num_layers} residual blocks per head")
    said_heads = config.get("medusa_num_heads")
    if said_heads is not None and int(said_heads) > num_heads:
        raise HeadsConfigError(f"{where}: config.json says medusa_num_heads {said_heads}, the weights hold "
                               f"{num_heads} heads")
