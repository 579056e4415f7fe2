"""Attention whose every shape is fixed by the batch's shape alone: what a captured CUDA graph can replay.

A CUDA graph replays the kernels it recorded, with the shapes it recorded, so the attention inside one may
not size anything by a sequence's length (``SdpaAttention`` gathers each sequence's own context, sized by
host-side lengths; flash-attn's paged kernels read lengths on the device, but flash-attn is not always
installed). This backend reads, for each of B sequences, the whole window its block table spans (``M``
blocks: ``C = M * block_size`` keys), and masks the keys past the sequence's length on the device:

    key j is visible to new token i of sequence b  iff  j < seq_lens_k[b] - q + i + 1

where every sequence brings the same ``q`` new tokens (a decode step: 1; a verify step of a chain: k + 1).
So the work is B x C whatever the lengths: ``tandem.step_graphs`` captures a graph per bucket of
context window, so that C is at most about twice the longest context.

Grouped-query attention without copying K/V per query head: the query heads sharing a KV head are laid
side by side as extra query rows of that head (``[B, Hkv, group * q, D]``), the mask repeated per group.
Chains only: a speculation tree's rows see their own paths, which this mask does not describe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.attention.base import AttentionMetadata


class PaddedPagedAttention:
    name = "padded"

    def prepare(self, meta: AttentionMetadata) -> torch.Tensor:  # -> visible [B, 1, q, C] bool
        """The visibility mask every layer shares, from device tensors only (no host lengths)."""
        if meta.has_tree:
            raise ValueError("padded attention computes chains only, and this batch holds a speculation tree")
        tables = meta.block_tables  # [B, M]
        batch = tables.shape[0]
        query_len = int(meta.slot_mapping.shape[0]) // batch
        window = tables.shape[1] * meta.block_size
        device = tables.device
        key_pos = torch.arange(window, device=device)  # [C]
        # [B, q]: keys visible to each new token, its own included
        limit = meta.seq_lens_k[:, None] - query_len + 1 + torch.arange(query_len, device=device)[None, :]
        return (key_pos[None, None, :] < limit[:, :, None])[:, None]  # [B, 1, q, C]

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D], T = B * q, sequence-major
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        state: torch.Tensor,  # [B, 1, q, C] from ``prepare``
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        batch, _, query_len, window = state.shape
        num_tokens, heads, head_dim = query.shape
        kv_heads = key_cache.shape[2]
        group = heads // kv_heads
        blocks = meta.block_tables.reshape(-1)  # [B * M]

        def window_of(cache: torch.Tensor) -> torch.Tensor:  # -> [B, Hkv, C, D]
            rows = cache.index_select(0, blocks).view(batch, window, kv_heads, head_dim)
            return rows.transpose(1, 2)

        # head h reads KV head h // group: its rows go after the other heads of that group
        q = query.view(batch, query_len, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)  # [B, Hkv, g, q, D]
        q = q.reshape(batch, kv_heads, group * query_len, head_dim)
        mask = state.expand(batch, group, query_len, window).reshape(batch, 1, group * query_len, window)
        out = F.scaled_dot_product_attention(q, window_of(key_cache), window_of(value_cache), attn_mask=mask,
                                             scale=scale)  # [B, Hkv, g * q, D]
        out = out.view(batch, kv_heads, group, query_len, head_dim).permute(0, 3, 1, 2, 4)  # [B, q, Hkv, g, D]
        return out.reshape(num_tokens, heads, head_dim)
