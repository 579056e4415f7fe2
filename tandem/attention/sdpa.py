"""Attention through PyTorch's ``scaled_dot_product_attention`` (any device), batch-invariant.

Every sequence is computed on its own, so a token's result never depends on
what else shares the forward pass:

- prompt runs (``meta.prompt_runs``: a prefill, a chunk of one, what the
  prefix cache left of one), and any run longer than ``ROWWISE_MAX_QUERY``,
  go in fixed pieces: positions ``[j * PIECE, (j + 1) * PIECE)`` are one SDPA
  call of ``PIECE`` query rows per query head, the G heads of a KV head
  stacked as its rows (rows the run does not hold are zero queries, their
  output dropped) over ``(j + 1) * PIECE`` keys (those past a row's
  position masked, whatever their slots hold). SDPA blocks its work by the
  query and key counts, so a row's result depends on them; with the counts
  fixed by its position alone, a prompt row is bitwise the same whether its
  prompt was computed in one run, in chunks of any size, or after a cached
  prefix of any length (docs/DESIGN.md, "Prefix caching"). The work is that
  of one causal call, plus at most one piece of padding at each end of a run:
  ``PIECE`` is small (4) so that a chunk of a few tokens beside running
  streams pays little for it: at a context of 3,800, 4 prompt tokens beside 4
  decode rows of Qwen2.5-Coder-1.5B (bf16, 2-core Xeon) add about 100 ms to
  the step with pieces of 4, 120 ms with 8, 160 ms with 16 (a whole piece's
  attention is paid whatever the chunk holds of it), while a whole 2,000-token
  prefill takes 29-31 s with any of them (two runs).
- other short query runs (decode: 1 token, verify: k+1 tokens; up to
  ``ROWWISE_MAX_QUERY``) go row by row: each new token attends, without a
  mask, over exactly the keys it may see, which is the very computation a
  one-token decode step does. The reduction over keys has the same length
  and order whether a token is decoded alone, verified among k drafts, or
  batched with other sequences, so bf16 results are bitwise identical
  across those paths and speculative greedy output equals plain greedy
  output (see also ``RowStableLinear``).

A tree sequence (``meta.tree_parents``, at most ``ROWWISE_MAX_QUERY`` tokens)
always goes row by row: row ``i`` attends over the context, its ancestors in
depth order and itself, written after the context in a keys buffer the tree's
rows share (the context is gathered once per layer). Those keys have
the shape, layout and values of the keys a chain row at the same depth slices,
so every path of a tree gets bitwise the logits of a chain forward of that path.

``prepare`` gathers each sequence's cached K/V slots (and a tree row's own
slots) and builds the masks once per forward; every layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.attention.base import AttentionMetadata
from tandem.tree_rows import path_to

ROWWISE_MAX_QUERY = 16
PIECE = 4  # query rows (and the step of key counts) of one prompt-attention call; see the module doc


@dataclass(frozen=True, slots=True)
class TreeGather:
    """The flat cache slots a tree sequence's rows attend over: each row sees ``context`` then its path."""

    context: torch.Tensor  # [ctx] int64, the cached context's slots by position
    paths: list[torch.Tensor]  # per new token, [depth + 1] int64: its ancestors' slots in depth order, then its own


@dataclass(slots=True)
class SdpaState:
    kv_gather: torch.Tensor  # [num_seqs, max_kv] int64 flat cache slots (past a sequence's end: slot 0, masked)
    # [PIECE, max_kv] additive mask: row r of piece j sees key k iff k <= j * PIECE + r, as the
    # columns [max_kv - (j + 1) * PIECE, max_kv) of this staircase (None: no long run in the batch)
    staircase: torch.Tensor | None
    # tree sequence index -> the flat slots its rows attend over (``tree_row_gathers``)
    tree_gathers: dict[int, TreeGather]
    # query heads per KV head -> [PIECE * G, max_kv] the staircase's rows each repeated G times
    # (``_attend_pieces``' grouped query rows), made by the first layer that needs it
    grouped_staircases: dict[int, torch.Tensor] = field(default_factory=dict)


class SdpaAttention:
    name = "sdpa"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def prepare(self, meta: AttentionMetadata) -> SdpaState:
        device = meta.slot_mapping.device
        bs = meta.block_size
        long = [c + q for c, q, p in zip(meta.context_lens, meta.query_lens, meta.prompt_runs) if in_pieces(q, p)]
        max_kv = max(meta.max_seq_len_k, _pieces_end(max(long)) if long else 0)
        positions = torch.arange(max_kv, device=device)  # [max_kv]
        blocks = meta.block_tables.to(torch.int64)  # [num_seqs, max_blocks]
        block_idx = torch.clamp(positions // bs, max=blocks.shape[1] - 1)  # [max_kv]
        slots = blocks[:, block_idx] * bs + positions % bs  # [num_seqs, max_kv]
        valid = positions[None, :] < meta.seq_lens_k.to(device=device, dtype=torch.int64)[:, None]
        kv_gather = torch.where(valid, slots, torch.zeros_like(slots))
        staircase = None
        if long:
            # Row r, key column c: visible iff c <= max_kv - PIECE + r (a piece's own diagonal block last).
            visible = positions[None, :] <= torch.arange(PIECE, device=device)[:, None] + (max_kv - PIECE)
            staircase = torch.zeros(visible.shape, dtype=self.dtype, device=device)
            staircase.masked_fill_(~visible, torch.finfo(self.dtype).min)
        tree_gathers = {
            b: tree_row_gathers(kv_gather[b], ctx, parents)
            for b, (ctx, parents) in enumerate(zip(meta.context_lens, meta.tree_parents))
            if parents is not None
        }
        return SdpaState(kv_gather, staircase, tree_gathers)

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
            if not in_pieces(qlen, meta.prompt_runs[b]):
                gather = state.kv_gather[b, : ctx + qlen]
                keys = flat_k.index_select(0, gather).transpose(0, 1)[None]  # [1, Hkv, total, D]
                values = flat_v.index_select(0, gather).transpose(0, 1)[None]  # [1, Hkv, total, D]
                for i in range(qlen):
                    visible = ctx + i + 1
                    pieces.append(_attend_row(rows[i], keys[:, :, :visible], values[:, :, :visible], scale))
            else:
                assert state.staircase is not None
                gather = state.kv_gather[b, : _pieces_end(ctx + qlen)]
                keys = flat_k.index_select(0, gather).transpose(0, 1)[None]  # [1, Hkv, extent, D]
                values = flat_v.index_select(0, gather).transpose(0, 1)[None]  # [1, Hkv, extent, D]
                pieces.extend(_attend_pieces(rows, ctx, keys, values, _grouped_staircase(state, rows, keys), scale))
            token += qlen
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def in_pieces(query_len: int, prompt: bool) -> bool:
    """Whether a run's attention goes in fixed pieces (a prompt run, or too long for row by row) (module doc)."""
    return prompt or query_len > ROWWISE_MAX_QUERY


def _pieces_end(length: int) -> int:
    """Keys the last piece of a run ending at ``length`` reads: ``length`` rounded up to a whole piece."""
    return -(-length // PIECE) * PIECE


def _grouped_staircase(
    state: SdpaState,
    rows: torch.Tensor,  # [q, H, D]
    keys: torch.Tensor,  # [1, Hkv, extent, D]
) -> torch.Tensor:  # [PIECE * G, max_kv]
    """The staircase with each row repeated once per query head of a KV head (made once per forward)."""
    assert state.staircase is not None
    group = rows.shape[1] // keys.shape[1]
    grouped = state.grouped_staircases.get(group)
    if grouped is None:
        grouped = state.grouped_staircases[group] = state.staircase.repeat_interleave(group, dim=0)
    return grouped


def _attend_pieces(
    rows: torch.Tensor,  # [q, H, D], the run's queries, at positions ctx .. ctx + q - 1
    ctx: int,
    keys: torch.Tensor,  # [1, Hkv, extent, D], the sequence's keys (past its end: masked slots)
    values: torch.Tensor,  # [1, Hkv, extent, D]
    staircase: torch.Tensor,  # [PIECE * G, max_kv]: ``_grouped_staircase``
    scale: float,
) -> list[torch.Tensor]:  # [rows of a piece, H, D] each, in order
    """The run in fixed pieces (module doc): piece j is PIECE query rows over (j + 1) * PIECE keys.

    As in ``_attend_row``, the G query heads that share a KV head are that head's query rows
    (in KV head h's rows, row r * G + g is piece row r of query head h * G + g), so one call per
    piece reads K/V as they are:
    ``enable_gqa`` copied a piece's keys and values G times per call, which made prompt attention
    a quarter of a 391-token prefill of Qwen2.5-Coder-1.5B (G = 6) on a 2-core EPYC.
    """
    out, start, end = [], ctx, ctx + rows.shape[0]
    num_heads, num_kv_heads, head_dim = rows.shape[1], keys.shape[1], rows.shape[2]
    group = num_heads // num_kv_heads
    width = staircase.shape[1]
    while start < end:
        base = start // PIECE * PIECE
        stop = min(end, base + PIECE)
        piece_rows = rows.new_zeros(PIECE, num_heads, head_dim)  # [PIECE, H, D], zero rows the run lacks
        piece_rows[start - base:stop - base] = rows[start - ctx:stop - ctx]
        # [PIECE, Hkv, G, D] -> [1, Hkv, PIECE * G, D]
        query = piece_rows.view(PIECE, num_kv_heads, group, head_dim).transpose(0, 1).reshape(
            1, num_kv_heads, PIECE * group, head_dim)
        extent = base + PIECE
        mask = staircase[:, width - extent:]  # [PIECE * G, extent]: row r * G + g sees keys <= base + r
        attended = F.scaled_dot_product_attention(
            query, keys[:, :, :extent], values[:, :, :extent], attn_mask=mask, scale=scale,
        )  # [1, Hkv, PIECE * G, D]
        piece = attended[0].view(num_kv_heads, PIECE, group, head_dim).transpose(0, 1).reshape(
            PIECE, num_heads, head_dim)  # [PIECE, H, D]
        out.append(piece[start - base:stop - base])
        start = stop
    return out


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
    tree: TreeGather,
    flat_k: torch.Tensor,  # [slots, Hkv, D]
    flat_v: torch.Tensor,  # [slots, Hkv, D]
    scale: float,
) -> list[torch.Tensor]:  # [1, H, D] per row
    """A tree's rows, each over the keys a chain of its path would see.

    The context is gathered once into the head of a buffer; each row then writes its own
    path (its ancestors in depth order, then itself) after it and attends over the
    buffer's first ``ctx + depth + 1`` rows. Gathering the whole context per row made
    the gathers a fifth of a 12-node verify of Qwen2.5-Coder-1.5B at a context of 1,000
    (2-core EPYC). The buffer ``[ctx + deepest, Hkv, D]`` sliced and transposed has the
    inner strides of the chain's ``keys[:, :, :visible]`` (only the stride of the size-1
    batch axis differs, as it does between chains of different lengths), so the SDPA
    call is the chain row's call, bit for bit. Rows reuse the buffer one after another:
    each SDPA call has read it before the next row's path overwrites it (at once on a
    CPU, in stream order on a GPU).
    """
    ctx = tree.context.shape[0]
    deepest = max(path.shape[0] for path in tree.paths)
    key_buffer = flat_k.new_empty(ctx + deepest, *flat_k.shape[1:])  # [ctx + deepest, Hkv, D]
    value_buffer = flat_v.new_empty(ctx + deepest, *flat_v.shape[1:])
    torch.index_select(flat_k, 0, tree.context, out=key_buffer[:ctx])
    torch.index_select(flat_v, 0, tree.context, out=value_buffer[:ctx])
    pieces = []
    for row, path in zip(rows, tree.paths):
        visible = ctx + path.shape[0]
        torch.index_select(flat_k, 0, path, out=key_buffer[ctx:visible])
        torch.index_select(flat_v, 0, path, out=value_buffer[ctx:visible])
        keys = key_buffer[:visible].transpose(0, 1)[None]  # [1, Hkv, visible, D]
        values = value_buffer[:visible].transpose(0, 1)[None]  # [1, Hkv, visible, D]
        pieces.append(_attend_row(row, keys, values, scale))
    return pieces


def tree_row_gathers(seq_slots: torch.Tensor, ctx: int, parents: list[int]) -> TreeGather:
    """A tree's flat slots: its context's, and per new token its path from the root (then itself).

    ``seq_slots`` ``[>= ctx + q]`` are the sequence's flat slots by position; new token ``i``
    was written at position ``ctx + i``.
    """
    if len(parents) > ROWWISE_MAX_QUERY:
        raise ValueError(
            f"a tree of {len(parents)} new tokens: at most {ROWWISE_MAX_QUERY} can be attended row by row"
        )
    paths = [
        seq_slots[torch.tensor(path_to(parents, i), dtype=torch.int64, device=seq_slots.device) + ctx]
        for i in range(len(parents))
    ]  # [depth + 1] each
    return TreeGather(seq_slots[:ctx], paths)
