"""FlashAttention-2 on CUDA, reading the paged KV cache through block tables.

Decode-only batches (one new token per sequence) go through
``flash_attn_with_kvcache``; ragged prefill/verify batches through
``flash_attn_varlen_func`` with ``block_table``. Both align the causal mask
bottom-right (a query sees every cached key before it), which is the
semantics our other backends implement with explicit masks.

flash-attn's kernels take no custom mask, so a batch holding a speculation tree
(``meta.has_tree``) is computed through ``SdpaAttention``'s math instead, whole
batch at once (its chains too: one backend state per forward); chains-only
batches keep the flash kernels. That is correct everywhere but slower on CUDA;
a serving GPU would rather use FlexAttention or a kernel that takes a custom
mask (tree rows see the context plus their own path).

The flash-attn module is passed in rather than imported at module level, so
that the plumbing can be tested on a CPU against the reference backend with
a stand-in module that has the same functions and argument contract.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from tandem.attention.base import AttentionMetadata
from tandem.attention.sdpa import SdpaAttention, SdpaState

# flash-attn's paged kernels require a page (block) size that is a multiple of this.
FLASH_PAGE_MULTIPLE = 256


def import_flash_attn() -> ModuleType:
    """The installed ``flash_attn`` package, or a clear error naming the extra to install."""
    try:
        import flash_attn  # type: ignore[import-not-found]
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "attention backend 'flash' needs the flash-attn package on a CUDA machine: "
            "pip install 'tandem[gpu]'"
        ) from exc
    return flash_attn


class FlashAttention:
    name = "flash"

    def __init__(
        self, block_size: int, flash_module: ModuleType | Any | None = None, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        """``dtype``: the model's, for the masks of the SDPA path that batches with a tree take."""
        if block_size % FLASH_PAGE_MULTIPLE:
            raise ValueError(
                f"flash-attn paged KV needs block_size to be a multiple of {FLASH_PAGE_MULTIPLE}, got {block_size}"
            )
        self.flash = flash_module if flash_module is not None else import_flash_attn()
        self.tree_fallback = SdpaAttention(dtype)

    def prepare(self, meta: AttentionMetadata) -> SdpaState | None:
        """None for the flash kernels; the SDPA state when the batch holds a tree."""
        return self.tree_fallback.prepare(meta) if meta.has_tree else None

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, H, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        state: SdpaState | None,
        scale: float,
    ) -> torch.Tensor:
        if state is not None:
            return self.tree_fallback.forward(query, key_cache, value_cache, meta, state, scale)
        if meta.is_decode_only:
            out = self.flash.flash_attn_with_kvcache(
                query.unsqueeze(1),  # [B, 1, H, D]
                key_cache,
                value_cache,
                cache_seqlens=meta.seq_lens_k,  # [B] int32, includes the token just written
                block_table=meta.block_tables,  # [B, max_blocks] int32
                softmax_scale=scale,
                causal=True,
            )  # [B, 1, H, D]
            return out.squeeze(1)
        return self.flash.flash_attn_varlen_func(
            query,
            key_cache,
            value_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len_k,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables,
        )  # [num_tokens, H, D]


class FlashKVCacheGraphAttention:
    """flash-attn's paged kernel for batches where every sequence brings the same ``q`` new tokens as a chain, its
    shapes fixed by the batch's shape alone: what a captured CUDA graph replays (``tandem.step_graphs``) where
    flash-attn is installed. It reads each sequence's own length on the device (``cache_seqlens``), so unlike
    ``PaddedPagedAttention`` it reads only the keys a sequence has, whatever window its graph was captured for."""

    name = "flash-graph"

    def __init__(self, flash_module: ModuleType | Any) -> None:
        self.flash = flash_module

    def prepare(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # [B] int32, [B, M] int32
        """The kernel's int32 lengths and block tables (a graph's buffers hold int64), made once per forward."""
        if meta.has_tree:
            raise ValueError("graph attention computes chains only, and this batch holds a speculation tree")
        return meta.seq_lens_k.to(torch.int32), meta.block_tables.to(torch.int32)

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D], T = B * q, sequence-major
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        state: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        seq_lens, tables = state
        batch = tables.shape[0]
        out = self.flash.flash_attn_with_kvcache(
            query.view(batch, query.shape[0] // batch, *query.shape[1:]),  # [B, q, H, D]
            key_cache, value_cache, cache_seqlens=seq_lens, block_table=tables, softmax_scale=scale, causal=True,
        )  # [B, q, H, D]
        return out.reshape(query.shape)
