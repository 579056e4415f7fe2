"""Slow, obviously-correct attention: the oracle the other backends are tested against.

It walks each sequence's block table by hand, one query token at a time,
in float32; a tree row sees the context, its ancestors and itself. Never used
for serving.
"""

from __future__ import annotations

import torch

from tandem.attention.base import AttentionMetadata
from tandem.tree_rows import path_to


class ReferenceAttention:
    name = "reference"

    def prepare(self, meta: AttentionMetadata) -> None:
        return None

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, H, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        state: None,
        scale: float,
    ) -> torch.Tensor:
        num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
        group = num_heads // num_kv_heads
        out = torch.empty_like(query)
        token = 0
        for b, (ctx, qlen, parents) in enumerate(zip(meta.context_lens, meta.query_lens, meta.tree_parents)):
            total = ctx + qlen
            positions = torch.arange(total)
            blocks = meta.block_tables[b].long().cpu()[positions // meta.block_size]
            offsets = positions % meta.block_size
            keys = key_cache[blocks, offsets].float()  # [total, Hkv, D]
            values = value_cache[blocks, offsets].float()  # [total, Hkv, D]
            for i in range(qlen):
                seen = _visible_positions(ctx, i, parents)
                for h in range(num_heads):
                    kv_head = h // group
                    q = query[token + i, h].float()  # [D]
                    scores = keys[seen, kv_head] @ q * scale  # [visible]
                    probs = torch.softmax(scores, dim=0)
                    out[token + i, h] = (probs @ values[seen, kv_head]).to(query.dtype)
            token += qlen
        return out


def _visible_positions(ctx: int, row: int, parents: list[int] | None) -> list[int]:
    """Causal: a token sees itself and everything before it; in a tree, the context and its own path."""
    if parents is None:
        return list(range(ctx + row + 1))
    return [*range(ctx), *(ctx + r for r in path_to(parents, row))]
