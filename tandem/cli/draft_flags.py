"""The flags that make a draft model lean (int8 weights, a cut vocabulary), shared by every command that loads one."""

from __future__ import annotations

import argparse
from typing import Any

from tandem.config import DEFAULT_DRAFT_QUANTIZATION, DEFAULT_DRAFT_VOCAB_LIMIT, QUANTIZATIONS


def add_draft_flags(p: argparse.ArgumentParser, prefix: str = "--draft-") -> None:
    """``{prefix}quantization`` and ``{prefix}vocab``; ``serve draft`` passes ``--`` as the prefix."""
    p.add_argument(f"{prefix}quantization", dest="draft_quantization", default=DEFAULT_DRAFT_QUANTIZATION,
                   choices=QUANTIZATIONS,
                   help="draft weights: int8 halves the bytes a draft step reads; proposals are checked by the "
                        "target, so output is unchanged. auto: int8, except in float32, where the int8 kernel "
                        "has no fast path and a dense draft is faster (default: %(default)s)")
    p.add_argument(f"{prefix}vocab", dest="draft_vocab", type=int, default=DEFAULT_DRAFT_VOCAB_LIMIT, metavar="N",
                   help="the draft scores only the first N token ids (the most common in BPE order); "
                        "0: the whole vocabulary (default: %(default)s)")


def draft_engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the flags above."""
    return {"quantization": args.draft_quantization, "vocab_limit": args.draft_vocab or None}


def draft_worker_args(args: argparse.Namespace) -> list[str]:
    """The same choices as ``tandem serve draft`` arguments, for commands that spawn draft workers."""
    return ["--quantization", args.draft_quantization, "--vocab", str(args.draft_vocab)]
