"""Heads for a loaded target: read them, check they belong to it, and build the drafter the target worker runs."""

from __future__ import annotations

from pathlib import Path

from tandem.engine import ModelEngine
from tandem.heads.drafters import EagleDrafter, HeadDrafter, MedusaDrafter
from tandem.heads.fingerprint import target_fingerprint
from tandem.heads.store import Heads, load_heads
from tandem.models.packed import pack_linear_weights
from tandem.models.row_padding import PaddingTuner

EAGLE_DEPTH = 5  # drafting steps of an EAGLE tree (EAGLE-2 uses 5-6)
TREE_WIDTH = 4  # candidates per node, and nodes expanded per depth


def drafter_for(heads: Heads, target: ModelEngine, where: str = "given") -> HeadDrafter:
    """The drafter of ``heads`` over ``target``'s hidden states; heads made for another target are refused."""
    heads.config.check_target(target.config, target_fingerprint(target.model), where)
    if heads.config.kind == "medusa":
        return MedusaDrafter(heads, width=TREE_WIDTH)  # type: ignore[arg-type]
    if any(getattr(m, "packed_weight", None) is not None for m in target.model.modules()):
        pack_linear_weights(heads, PaddingTuner())  # the layer's linears as the target's: packed, row-invariant
    cache = target.kv_cache  # the head's KV holds one pair per target KV position: the same pool size
    return EagleDrafter(heads, target.model.embed_tokens, cache.num_blocks, cache.block_size,  # type: ignore[arg-type]
                        depth=EAGLE_DEPTH, width=TREE_WIDTH, prefix_caching=cache.prefix_caching, salt=cache.salt)


def load_drafter(path: Path | str, target: ModelEngine) -> HeadDrafter:
    """Heads from ``path`` (any known layout) on the target's device and dtype, checked against it."""
    heads = load_heads(Path(path), target.dtype, target.device, target_num_layers=target.config.num_layers)
    return drafter_for(heads, target, str(path))
