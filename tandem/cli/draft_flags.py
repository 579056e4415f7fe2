"""The flags that make a draft model lean (int8 weights, a cut vocabulary, its own dtype), shared by every
command that loads one."""

from __future__ import annotations

import argparse
from typing import Any

from tandem.config import DEFAULT_DRAFT_QUANTIZATION, DEFAULT_DRAFT_VOCAB_LIMIT, DTYPES, QUANTIZATIONS


def add_draft_flags(p: argparse.ArgumentParser, prefix: str = "--draft-") -> None:
    """``{prefix}quantization``, ``{prefix}vocab`` and ``--draft-dtype``; ``serve draft`` passes ``--`` as the
    prefix (its ``--dtype`` is the worker's own)."""
    if prefix == "--draft-":
        p.add_argument("--draft-dtype", default="auto", choices=("auto", *DTYPES),
                       help="the draft's dtype, whatever the target's: its numbers only steer proposals. auto: "
                            "bfloat16 with int8 weights on a CPU whose oneDNN runs bf16, when --draft-quantization is "
                            "auto (the int8 kernel is fast even where bf16 is emulated), else as --dtype auto would "
                            "(default: %(default)s)")
    p.add_argument(f"{prefix}quantization", dest="draft_quantization", default=DEFAULT_DRAFT_QUANTIZATION,
                   choices=QUANTIZATIONS,
                   help="draft weights: int8 halves the bytes a draft step reads; proposals are checked by the "
                        "target, so output is unchanged. auto: int8, except in float32, where the int8 kernel "
                        "has no fast path and a dense draft is faster (default: %(default)s)")
    p.add_argument(f"{prefix}vocab", dest="draft_vocab", type=int, default=DEFAULT_DRAFT_VOCAB_LIMIT, metavar="N",
                   help="the draft scores only the first N token ids (the most common in BPE order); "
                        "0: the whole vocabulary (default: %(default)s)")


def draft_engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the flags above (``dtype`` too where ``--draft-dtype`` exists)."""
    options: dict[str, Any] = {"quantization": args.draft_quantization, "vocab_limit": args.draft_vocab or None}
    if hasattr(args, "draft_dtype"):
        options["dtype"] = args.draft_dtype
    return options


def draft_worker_args(args: argparse.Namespace) -> list[str]:
    """The same choices as ``tandem serve draft`` arguments, for commands that spawn draft workers
    (placed after the workers' common ``--dtype``, so that the draft's own wins)."""
    dtype = ["--dtype", args.draft_dtype] if hasattr(args, "draft_dtype") else []
    return ["--quantization", args.draft_quantization, "--vocab", str(args.draft_vocab), *dtype]
