"""Tandem's own heads files: ``heads.json`` (``HeadsConfig``) beside ``heads.safetensors`` (the weights).

``load_heads`` reads any layout Tandem knows (``tandem.heads.formats`` detects the
Medusa project's and the speculators library's), checks the heads against the
target, and returns the module on the target's device and dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tandem.heads.config import HeadsConfig, HeadsConfigError
from tandem.heads.eagle import EagleHead
from tandem.heads.medusa import MedusaHeads
from tandem.models.layers import RotaryEmbedding

CONFIG_FILE = "heads.json"
WEIGHTS_FILE = "heads.safetensors"

Heads = MedusaHeads | EagleHead


def build_heads(cfg: HeadsConfig) -> Heads:
    return MedusaHeads(cfg) if cfg.kind == "medusa" else EagleHead(cfg)


def save_heads(heads: Heads, directory: Path) -> None:
    """Write ``heads`` in Tandem's layout (fp32 weights stay fp32: a file does not decide the serving dtype)."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu").contiguous() for name, t in heads.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_FILE))
    heads.config.save(directory / CONFIG_FILE)


def is_tandem_layout(directory: Path) -> bool:
    return (directory / CONFIG_FILE).is_file() and (directory / WEIGHTS_FILE).is_file()


def load_tandem_layout(directory: Path) -> tuple[HeadsConfig, dict[str, torch.Tensor]]:
    cfg = HeadsConfig.load(directory / CONFIG_FILE)
    return cfg, load_file(str(directory / WEIGHTS_FILE))


def instantiate(cfg: HeadsConfig, state: dict[str, torch.Tensor], where: str,
                dtype: torch.dtype, device: torch.device) -> Heads:
    """The module for ``cfg`` holding ``state`` (its own names), every tensor checked for shape."""
    with torch.device("meta"):
        heads = build_heads(cfg)
    expected = heads.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise HeadsConfigError(f"heads {where}: missing tensors {missing[:6]}, unexpected {unexpected[:6]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise HeadsConfigError(f"heads {where}: tensor {name} has shape {tuple(tensor.shape)}, "
                                   f"the config implies {tuple(expected[name].shape)}")
    if not bool(((state["d2t"] >= 0) & (state["d2t"] < cfg.vocab_size)).all()):
        raise HeadsConfigError(f"heads {where}: d2t maps draft ids outside the target's vocabulary")
    cast = {name: t.to(device, torch.int64 if name == "d2t" else dtype) for name, t in state.items()}
    heads.load_state_dict(cast, assign=True)
    if isinstance(heads, EagleHead):  # buffers the file does not hold (rotary inverse frequencies): made for real
        heads.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    heads.requires_grad_(False)
    return heads.eval()


def load_heads(path: Path, dtype: torch.dtype, device: torch.device, target_num_layers: int | None = None) -> Heads:
    """Heads from ``path`` in any known layout (not yet checked against a target: ``HeadsConfig.check_target``).

    ``target_num_layers``: the target's layer count, which EAGLE-3 heads that do not name their layers need."""
    from tandem.heads.formats import read_any_layout  # the public layouts' readers

    cfg, state = read_any_layout(Path(path), target_num_layers)
    return instantiate(cfg, state, str(path), dtype, device)


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
