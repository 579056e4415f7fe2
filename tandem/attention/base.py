"""The attention interface every backend implements, and the batch metadata it reads.

A forward pass covers a ragged batch: sequence ``b`` already has
``context_lens[b]`` tokens in the paged KV cache and brings ``query_lens[b]``
new ones (1 when decoding, k+1 when verifying, many when prefilling). New
tokens are flattened into one ``[num_tokens, ...]`` axis in sequence order;
``cu_seqlens_q`` marks where each sequence starts. New K/V are written into
the cache before attention runs, so a backend only ever reads the cache.

A sequence's new tokens may form a speculation tree instead of a chain
(``tree_parents``, see ``tandem.tree_rows``): new token ``i`` is still written
at slot position ``context + i``, but it sees the context, its ancestors and
itself only. Chains (``None``) are the common case and cost nothing extra.

Metadata is built once per forward (``AttentionMetadata.build``); each backend
derives whatever it needs from it once too (``prepare``), and every layer
reuses that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tandem.tree_rows import parents_problem


@dataclass(slots=True)
class AttentionMetadata:
    """Flat variable-length description of one batch (vLLM-style ``cu_`` offsets)."""

    query_lens: list[int]  # host copy, [num_seqs]
    context_lens: list[int]  # host copy, [num_seqs]: tokens cached before this step
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32, offsets of each sequence's new tokens
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32, offsets of each sequence's total tokens
    seq_lens_k: torch.Tensor  # [num_seqs] int32, context + query length
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    block_size: int
    # [num_seqs] per sequence: None for a chain, else each new token's parent row (-1: the context)
    tree_parents: list[list[int] | None]
    # [num_seqs] per sequence: its new tokens are prompt tokens (prefill, a chunk of one, what the prefix
    # cache left of one). Attention computes every row by position alone whatever the run (tandem/attention/sdpa.py);
    # the linear layers of an unpacked bf16 model give a prompt run a call of its own (RowBlocks).
    prompt_runs: list[bool]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len_k(self) -> int:
        return max(c + q for c, q in zip(self.context_lens, self.query_lens))

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    @property
    def has_tree(self) -> bool:
        return any(p is not None for p in self.tree_parents)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        device: torch.device,
        tree_parents: list[list[int] | None] | None = None,
        prompt_runs: list[bool] | None = None,
    ) -> AttentionMetadata:
        """``tree_parents``: per sequence, None for a chain (all chains when omitted) or its tree's parents;
        ``prompt_runs``: per sequence, whether its new tokens are prompt tokens (none when omitted)."""
        if tree_parents is None:
            tree_parents = [None] * len(query_lens)
        if prompt_runs is None:
            prompt_runs = [False] * len(query_lens)
        if len(tree_parents) != len(query_lens):
            raise ValueError(f"tree_parents describes {len(tree_parents)} sequences, the batch has {len(query_lens)}")
        if len(prompt_runs) != len(query_lens):
            raise ValueError(f"prompt_runs describes {len(prompt_runs)} sequences, the batch has {len(query_lens)}")
        for b, (parents, prompt) in enumerate(zip(tree_parents, prompt_runs)):
            if parents is not None and prompt:
                raise ValueError(f"sequence {b} of the batch: a prompt run cannot be a speculation tree")
        for b, (parents, qlen) in enumerate(zip(tree_parents, query_lens)):
            if parents is not None and (problem := parents_problem(parents, qlen)) is not None:
                raise ValueError(f"sequence {b} of the batch: {problem}")
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        cu_q = torch.tensor([0, *_cumsum(query_lens)], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, *_cumsum(seq_lens)], dtype=torch.int32, device=device)
        return cls(
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            seq_lens_k=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            slot_mapping=slot_mapping.to(device),
            block_tables=block_tables.to(device),
            block_size=block_size,
            tree_parents=list(tree_parents),
            prompt_runs=list(prompt_runs),
        )


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


class AttentionBackend(Protocol):
    """Causal attention of new tokens over their sequences' cached K/V."""

    name: str

    def prepare(self, meta: AttentionMetadata) -> Any:
        """Derive per-forward state (masks, gather indices) shared by every layer."""

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        state: Any,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attend each new token to its own sequence's first ``context + i + 1`` tokens.

        In a tree sequence, new token ``i`` sees the ``context`` cached tokens, then its
        ancestors in depth order, then itself: the keys a chain of just that path would see.
        """
