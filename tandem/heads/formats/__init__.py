"""Reading heads in the layouts other tools write, into Tandem's ``HeadsConfig`` and state dict names.

- Tandem's own (``tandem.heads.store``): ``heads.json`` + ``heads.safetensors``.
- The Medusa project's published heads (``tandem.heads.formats.medusa``).
- EAGLE-3 heads as vLLM's speculators library writes them, and the EAGLE-3 authors'
  own checkpoints (``tandem.heads.formats.speculators``).

A reader returns the config and the tensors under Tandem's names; ``store.instantiate``
then checks every name and shape against the module the config implies. Weights are
read from safetensors, or from a torch pickle only where ``torch.load(weights_only=True)``
accepts it: a pickle that needs more runs arbitrary code, and a heads file is no reason
to run it.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from tandem.heads.config import HeadsConfig, HeadsConfigError

LISTED_FILES = 12  # names shown when a directory holds nothing Tandem can read


def read_any_layout(path: Path, target_num_layers: int | None = None) -> tuple[HeadsConfig, dict[str, torch.Tensor]]:
    """``(HeadsConfig, state dict under Tandem's names)`` from a directory in any layout Tandem knows.

    ``target_num_layers``: the target's number of decoder layers. Only an EAGLE-3 checkpoint that
    does not name the target layers it reads needs it (vLLM's default then applies:
    layers 2, L // 2 and L - 3); pass it whenever the target is known.
    """
    from tandem.heads import store
    from tandem.heads.formats import medusa, speculators

    path = Path(path)
    if not path.exists():
        raise HeadsConfigError(f"no heads at {path}")
    if not path.is_dir():
        raise HeadsConfigError(f"heads at {path}: expected a directory (config and weights), found a file")
    if store.is_tandem_layout(path):
        return store.load_tandem_layout(path)
    config = read_config_json(path)
    if medusa.is_medusa_layout(path, config):
        return medusa.read_medusa(path, config)
    if speculators.is_eagle3_layout(config):
        return speculators.read_eagle3(path, config, target_num_layers)
    found = sorted(p.name for p in path.iterdir())
    shown = ", ".join(found[:LISTED_FILES]) + (f" and {len(found) - LISTED_FILES} more" if len(found) > LISTED_FILES
                                               else "")
    raise HeadsConfigError(
        f"{path} holds no heads Tandem can read (found: {shown or 'nothing'}): expected {store.CONFIG_FILE} + "
        f"{store.WEIGHTS_FILE} (Tandem's layout), a Medusa project directory (config.json with medusa_num_heads + "
        f"{' or '.join(medusa.WEIGHTS_FILES)}), or an EAGLE-3 directory (config.json with speculators_model_type "
        "\"eagle3\" or draft_vocab_size + model.safetensors)"
    )


def heads_kind(path: Path) -> str:
    """"medusa" or "eagle": the kind of the heads at ``path``, read from their config alone (no weights)."""
    from tandem.heads import store
    from tandem.heads.formats import medusa, speculators

    path = Path(path)
    if store.is_tandem_layout(path):
        return HeadsConfig.load(path / store.CONFIG_FILE).kind
    config = read_config_json(path) if path.is_dir() else None
    if config is not None and medusa.is_medusa_layout(path, config):
        return "medusa"
    if config is not None and speculators.is_eagle3_layout(config):
        return "eagle"
    return read_any_layout(path)[0].kind  # raises, naming what is there


# ----- helpers the readers share ------------------------------------------------------------------------------
def read_config_json(directory: Path) -> dict[str, Any] | None:
    """``directory/config.json`` as a dict, or None when there is none."""
    path = directory / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HeadsConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise HeadsConfigError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one weights file: safetensors, or a torch pickle ``torch.load(weights_only=True)`` accepts."""
    if path.name.endswith(".safetensors"):
        try:
            return load_file(str(path))
        except (OSError, SafetensorError) as exc:
            raise HeadsConfigError(f"cannot read {path}: {exc}") from None
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, TypeError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HeadsConfigError(
            f"{path} is a torch pickle that torch.load(weights_only=True) refuses ({first_line}); Tandem does not "
            "run a pickle's code: save the state dict (tensors only) with torch.save or safetensors' save_file, "
            "where you trust the file"
        ) from None
    if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                               for k, v in loaded.items()):
        raise HeadsConfigError(f"{path} holds a {type(loaded).__name__}, not a state dict of named tensors")
    return dict(loaded)


def load_weights(directory: Path, candidates: tuple[str, ...], what: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """The first of ``candidates`` present in ``directory``, loaded; a ``*.index.json`` names shards to merge."""
    for name in candidates:
        path = directory / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return path, load_tensors(path)
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise HeadsConfigError(f"cannot read the shard index {path}: {exc!r}") from None
        merged: dict[str, torch.Tensor] = {}
        for shard in shards:
            merged.update(load_tensors(directory / shard))
        return path, merged
    raise HeadsConfigError(f"{what} at {directory} has no weights file: expected one of {', '.join(candidates)}")


def check_shape(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], where: str) -> torch.Tensor:
    """``tensors[name]``, which must exist with ``shape`` (the error names the file's own tensor)."""
    if name not in tensors:
        raise HeadsConfigError(f"{where}: tensor {name} is missing")
    tensor = tensors[name]
    if tuple(tensor.shape) != tuple(shape):
        raise HeadsConfigError(f"{where}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    return tensor
