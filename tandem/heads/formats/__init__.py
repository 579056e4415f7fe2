"""Reading heads in the layouts other tools write, into Tandem's ``HeadsConfig`` and state dict names.

- Tandem's own (``tandem.heads.store``): ``heads.json`` + ``heads.safetensors``.
- The Medusa project's published heads (``tandem.heads.formats.medusa``).
- EAGLE-3 heads as vLLM's speculators library writes them (``tandem.heads.formats.speculators``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.heads.config import HeadsConfig, HeadsConfigError


def read_any_layout(path: Path) -> tuple[HeadsConfig, dict[str, torch.Tensor]]:
    from tandem.heads import store

    if not path.exists():
        raise HeadsConfigError(f"no heads at {path}")
    if store.is_tandem_layout(path):
        return store.load_tandem_layout(path)
    raise HeadsConfigError(
        f"{path} holds no heads Tandem can read: expected {store.CONFIG_FILE} + {store.WEIGHTS_FILE} (Tandem's "
        "layout), a Medusa project directory, or a speculators EAGLE-3 directory"
    )
