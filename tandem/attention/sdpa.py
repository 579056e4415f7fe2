"""Attention through PyTorch's ``scaled_dot_product_attention`` (any device), batch-invariant.

Every sequence is computed on its own, so a token's result never depends on
what else shares the forward pass:

- short query runs (decode: 1 token, verify: k+1 tokens; up to
  ``ROWWISE_MAX_QUERY``) go row by row: each new token attends, without a
  mask, over exactly the keys it may see, which is the very computation a
  one-token decode step does. The reduction over keys has the same length
  and order whether a token is decoded alone, verified among k drafts, or
  batched with other sequences, so bf16 results are bitwise identical
  across those paths and speculative greedy output equals plain greedy
  output (see also ``RowStableLinear``).
- long runs (prefill) take one call per sequence: ``is_causal`` when the
  sequence has no cached context, else an explicit offset-causal mask,
  because SDPA's ``is_causal`` aligns top-left when queries are fewer than
  keys, which is wrong with a KV cache. A run that is a chunk of a longer
  prompt (``meta.key_extents``) reads as many keys as the whole prompt's run
  (the ones not computed yet masked, from slot 0): SDPA blocks its reduction
  by the key count, so only then are its rows bitwise the whole run's.

A tree sequence (``meta.tree_parents``, at most ``ROWWISE_MAX_QUERY`` tokens)
always goes row by row: row ``i`` attends over the context, its ancestors in
depth order and itself, gathered into a keys tensor of its own. That tensor has
the shape, layout and values of the keys a chain row at the same depth slices,
so every path of a tree gets bitwise the logits of a chain forward of that path.

``prepare`` gathers each sequence's cached K/V slots (and a tree row's own
slots) and builds the masks once per forward; every layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.attention.base import AttentionMetadata
from tandem.tree_rows import path_to

ROWWISE_MAX_QUERY = 16


@dataclass(slots=True)
class SdpaState:
    kv_gather: torch.Tensor  # [num_seqs, max_kv] int64 flat cache slots (past a sequence's end: slot 0, unread)
    masks: dict[int, torch.Tensor]  # sequence index -> [1, 1, q, kv] additive mask, for chunked prefill only
    # tree sequence index -> per new token, the [visible] int64 flat slots it attends over, in order
    tree_gathers: dict[int, list[torch.Tensor]]


class SdpaAttention:
    name = "sdpa"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def prepare(self, meta: AttentionMetadata) -> SdpaState:
        device = meta.slot_mapping.device
        bs = meta.block_size
        positions = torch.arange(meta.max_key_extent, device=device)  # [max_kv]
        blocks = meta.block_tables.to(torch.int64)  # [num_seqs, max_blocks]
        block_idx = torch.clamp(positions // bs, max=blocks.shape[1] - 1)  # [max_kv]
        slots = blocks[:, block_idx] * bs + positions % bs  # [num_seqs, max_kv]
        valid = positions[None, :] < meta.seq_lens_k.to(device=device, dtype=torch.int64)[:, None]
        kv_gather = torch.where(valid, slots, torch.zeros_like(slots))
        masks = {}
        for b, (ctx, qlen) in enumerate(zip(meta.context_lens, meta.query_lens)):
            extent = _extent(meta, b)
            if qlen > ROWWISE_MAX_QUERY and extent > qlen:
                # Query i sits at position ctx + i and sees keys 0..ctx + i (of the extent's).
                q_pos = torch.arange(qlen, device=device)[:, None] + ctx  # [q, 1]
                visible = torch.arange(extent, device=device)[None, :] <= q_pos  # [q, kv]
                mask = torch.zeros(visible.shape, dtype=self.dtype, device=device)
                masks[b] = mask.masked_fill_(~visible, torch.finfo(self.dtype).min)[None, None]
        tree_gathers = {
            b: tree_row_gathers(kv_gather[b], ctx, parents)
            for b, (ctx, parents) in enumerate(zip(meta.context_lens, meta.tree_parents))
            if parents is not None
        }
        return SdpaState(kv_gather, masks, tree_gathers)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, H, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        state: SdpaState,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, H, D]
        flat_k = key_cache.view(-1, *key_cache.shape[-2:])  # [slots, Hkv, D]
        flat_v = value_cache.view(-1, *value_cache.shape[-2:])
        pieces: list[torch.Tensor] = []  # [rows, H, D] each, in token order
        token = 0
        for b, (ctx, qlen) in enumerate(zip(meta.context_lens, meta.query_lens)):
            rows = query[token : token + qlen]  # [q, H, D]
            tree = state.tree_gathers.get(b)
            if tree is not None:
                pieces.extend(_attend_tree(rows, tree, flat_k, flat_v, scale))
                token += qlen
                continue
            gather = state.kv_gather[b, : _extent(meta, b) if qlen > ROWWISE_MAX_QUERY else ctx + qlen]
            keys = flat_k[gather].transpose(0, 1)[None]  # [1, Hkv, total, D]
            values = flat_v[gather].transpose(0, 1)[None]  # [1, Hkv, total, D]
            if qlen <= ROWWISE_MAX_QUERY:
                for i in range(qlen):
                    visible = ctx + i + 1
                    pieces.append(_attend_row(rows[i], keys[:, :, :visible], values[:, :, :visible], scale))
            else:
                q = rows.transpose(0, 1)[None]  # [1, H, q, D]
                mask = state.masks.get(b)
                pieces.append(F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
                )[0].transpose(0, 1))  # [q, H, D]
            token += qlen
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _extent(meta: AttentionMetadata, b: int) -> int:
    """Keys sequence ``b``'s run reads: context + query, or more for a chunk of a longer prompt."""
    return meta.key_extents[b] if meta.key_extents else meta.context_lens[b] + meta.query_lens[b]


def _attend_row(
    row: torch.Tensor,  # [H, D], one new token's query heads
    keys: torch.Tensor,  # [1, Hkv, visible, D], exactly the keys it sees
    values: torch.Tensor,  # [1, Hkv, visible, D]
    scale: float,
) -> torch.Tensor:  # [1, H, D]
    num_heads, num_kv_heads = row.shape[0], keys.shape[1]
    # The query heads sharing a KV head become that head's query rows: one unmasked
    # call, no K/V repeated per head (about 6x cheaper than enable_gqa here).
    grouped = row.view(1, num_kv_heads, num_heads // num_kv_heads, -1)  # [1, Hkv, G, D]
    return F.scaled_dot_product_attention(grouped, keys, values, scale=scale).reshape(1, num_heads, -1)


def _attend_tree(
    rows: torch.Tensor,  # [q, H, D]
    row_slots: list[torch.Tensor],  # per row, [visible] flat slots (``tree_row_gathers``)
    flat_k: torch.Tensor,  # [slots, Hkv, D]
    flat_v: torch.Tensor,  # [slots, Hkv, D]
    scale: float,
) -> list[torch.Tensor]:  # [1, H, D] per row
    """A tree's rows, each over the keys a chain of its path would see.

    A row's keys are gathered on their own, in that chain's order: ``[visible, Hkv, D]``
    transposed has the inner strides of the chain's ``keys[:, :, :visible]`` (only the
    stride of the size-1 batch axis differs, as it does between chains of different
    lengths), so the SDPA call is the chain row's call, bit for bit.
    """
    pieces = []
    for row, slots in zip(rows, row_slots):
        keys = flat_k[slots].transpose(0, 1)[None]  # [1, Hkv, visible, D]
        values = flat_v[slots].transpose(0, 1)[None]  # [1, Hkv, visible, D]
        pieces.append(_attend_row(row, keys, values, scale))
    return pieces


def tree_row_gathers(seq_slots: torch.Tensor, ctx: int, parents: list[int]) -> list[torch.Tensor]:
    """Per new token of a tree, its visible flat slots: the context, then its path from the root.

    ``seq_slots`` ``[>= ctx + q]`` are the sequence's flat slots by position; new token ``i``
    was written at position ``ctx + i``.
    """
    if len(parents) > ROWWISE_MAX_QUERY:
        raise ValueError(
            f"a tree of {len(parents)} new tokens: at most {ROWWISE_MAX_QUERY} can be attended row by row"
        )
    context = seq_slots[:ctx]  # [ctx]
    gathers = []
    for i in range(len(parents)):
        path = torch.tensor(path_to(parents, i), dtype=torch.int64, device=seq_slots.device) + ctx  # [depth + 1]
        gathers.append(torch.cat([context, seq_slots[path]]))  # [ctx + depth + 1]
    return gathers
