"""Attention through PyTorch's ``scaled_dot_product_attention`` (any device).

Each forward, ``prepare`` turns the ragged batch into a padded one, once for
all layers: a gather index that pulls every sequence's cached K/V out of the
block pool, the scatter index that places flat query tokens into padded rows,
and an additive mask (0 visible / dtype-min hidden). The mask is explicit
because SDPA's ``is_causal`` aligns top-left when queries are fewer than keys,
which is wrong with a KV cache. Batch-1 decode needs no mask at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.attention.base import AttentionMetadata


@dataclass(slots=True)
class SdpaState:
    kv_gather: torch.Tensor  # [num_seqs, max_kv] int64 flat cache slots (padding reads slot 0, masked)
    query_rows: torch.Tensor | None  # [num_tokens] int64 row in the padded [num_seqs * max_q] layout; None if unpadded
    mask: torch.Tensor | None  # [num_seqs, 1, max_q, max_kv] additive, or None when every key is visible
    max_query_len: int


class SdpaAttention:
    name = "sdpa"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def prepare(self, meta: AttentionMetadata) -> SdpaState:
        device = meta.slot_mapping.device
        max_q, max_kv = meta.max_query_len, meta.max_seq_len_k
        bs = meta.block_size
        positions = torch.arange(max_kv, device=device)  # [max_kv]
        seq_lens = meta.seq_lens_k.to(device=device, dtype=torch.int64)  # [num_seqs]
        blocks = meta.block_tables.to(torch.int64)  # [num_seqs, max_blocks]
        block_idx = torch.clamp(positions // bs, max=blocks.shape[1] - 1)  # [max_kv]
        slots = blocks[:, block_idx] * bs + positions % bs  # [num_seqs, max_kv]
        valid_k = positions[None, :] < seq_lens[:, None]  # [num_seqs, max_kv]
        kv_gather = torch.where(valid_k, slots, torch.zeros_like(slots))

        single_decode = meta.num_seqs == 1 and max_q == 1
        if single_decode:
            return SdpaState(kv_gather, None, None, max_q)

        ctx = torch.tensor(meta.context_lens, device=device, dtype=torch.int64)  # [num_seqs]
        qlens = torch.tensor(meta.query_lens, device=device, dtype=torch.int64)  # [num_seqs]
        q_pos = torch.arange(max_q, device=device)  # [max_q]
        # Query i of sequence b sits at absolute position ctx[b] + i and sees keys 0..ctx[b] + i.
        visible = positions[None, None, :] <= (ctx[:, None, None] + q_pos[None, :, None])  # [B, max_q, max_kv]
        visible &= valid_k[:, None, :]
        # Padding query rows see key 0 only, so no row is fully masked (that would give NaN).
        pad_rows = q_pos[None, :] >= qlens[:, None]  # [B, max_q]
        visible |= pad_rows[:, :, None] & (positions == 0)[None, None, :]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=device)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)

        query_rows = None
        if meta.num_seqs > 1:
            seq_of_token = torch.repeat_interleave(torch.arange(meta.num_seqs, device=device), qlens)
            starts = meta.cu_seqlens_q[:-1].to(device=device, dtype=torch.int64)
            index_in_seq = torch.arange(int(qlens.sum()), device=device) - starts[seq_of_token]
            query_rows = seq_of_token * max_q + index_in_seq  # [num_tokens]
        return SdpaState(kv_gather, query_rows, mask[:, None], max_q)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, H, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        state: SdpaState,
        scale: float,
    ) -> torch.Tensor:
        num_seqs = meta.num_seqs
        num_heads, head_dim = query.shape[1], query.shape[2]
        flat_k = key_cache.view(-1, *key_cache.shape[-2:])  # [slots, Hkv, D]
        flat_v = value_cache.view(-1, *value_cache.shape[-2:])
        keys = flat_k[state.kv_gather].transpose(1, 2)  # [B, Hkv, max_kv, D]
        values = flat_v[state.kv_gather].transpose(1, 2)  # [B, Hkv, max_kv, D]
        if state.query_rows is None:
            q = query.view(num_seqs, -1, num_heads, head_dim)  # [B, max_q, H, D]
        else:
            padded = query.new_zeros(num_seqs * state.max_query_len, num_heads, head_dim)
            padded[state.query_rows] = query
            q = padded.view(num_seqs, state.max_query_len, num_heads, head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=state.mask, scale=scale, enable_gqa=True
        )  # [B, H, max_q, D]
        out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [B * max_q, H, D]
        return out if state.query_rows is None else out[state.query_rows]
