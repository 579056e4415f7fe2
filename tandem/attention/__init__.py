"""Attention backends behind one interface (see ``base.AttentionBackend``)."""

from __future__ import annotations

import logging

import torch

from tandem.attention.base import AttentionBackend, AttentionMetadata
from tandem.attention.flash import FlashAttention
from tandem.attention.reference import ReferenceAttention
from tandem.attention.sdpa import SdpaAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "make_backend"]

log = logging.getLogger(__name__)


def make_backend(name: str, dtype: torch.dtype, device: torch.device, block_size: int) -> AttentionBackend:
    """``auto`` picks flash-attn on CUDA when it is installed and can serve (fp16 or bf16, blocks of a
    multiple of 256 tokens), SDPA everywhere else."""
    if name == "auto":
        name = "sdpa"
        if device.type == "cuda" and block_size % 256 == 0 and dtype in (torch.float16, torch.bfloat16):
            try:
                import flash_attn  # type: ignore[import-not-found]  # noqa: F401

                name = "flash"
            except ModuleNotFoundError as exc:
                if exc.name != "flash_attn":  # installed, but something it imports is missing
                    log.warning("attention: flash-attn is installed but cannot load (%s); using SDPA", exc)
            except ImportError as exc:  # installed, but built against another torch ("undefined symbol")
                log.warning("attention: flash-attn is installed but cannot load (%s); using SDPA", exc)
    if name == "flash":
        return FlashAttention(block_size, dtype=dtype)
    if name == "reference":
        return ReferenceAttention()
    if name == "sdpa":
        return SdpaAttention(dtype)
    raise ValueError(f"unknown attention backend {name!r}")
