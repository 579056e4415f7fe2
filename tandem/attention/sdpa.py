"""Attention through PyTorch's ``scaled_dot_product_attention`` (any device), batch-invariant.

Every sequence is computed on its own, and every row's result is fixed by its
position alone: a token's keys and values are bitwise the same whether it was
a prompt token (computed in one run, in chunks, or after a cached prefix), a
decoded token, a verified draft or a node of a token tree, and whatever else
shares the forward pass. That makes speculative greedy output equal plain
greedy output (with ``RowStableLinear``), and it lets the prefix cache hold
the blocks of generated tokens beside prompt blocks: a conversation's next
turn reads the answer it sends back (docs/DESIGN.md, "Prefix caching").

How: positions ``[j * PIECE, (j + 1) * PIECE)`` are one piece, and a row is
always computed in its piece's call: ``PIECE`` query rows per query head, the
G heads of a KV head stacked as its rows (rows the call does not compute are
zero queries, their output dropped), over the keys up to the piece's end,
``(j + 1) * PIECE``, rounded up to a multiple of ``KEY_STEP`` (those past a
row's position masked by a staircase, whatever their slots hold). SDPA
blocks its work by the query and key counts of a call, so a row's result
depends on them; with the counts fixed by its position alone, the row is the
same in every case above.

- A chain run (a prompt, a chunk of one, what the prefix cache left of one; a
  decode step; a verified chain) is cut into the pieces it overlaps: one call
  per piece (on a CPU its pieces of one key count share a call, below), so a
  run costs one causal call plus at most one piece of padding at each end.
  ``PIECE`` is small (4) so that a chunk of a few tokens beside running
  streams pays little for it: at a context of 3,800, 4 prompt tokens
  beside 4 decode rows of Qwen2.5-Coder-1.5B (bf16, 2-core Xeon) add about
  100 ms to the step with pieces of 4, 120 ms with 8, 160 ms with 16, while a
  whole 2,000-token prefill takes 29-31 s with any of them (two runs).
- Decode and verify rows went row by row until then: one call of a row's G
  query rows over exactly the keys it sees. That is half the attention work of
  a piece (Qwen2.5-Coder-1.5B's shapes at 2,000 keys: 149 us against 333 us,
  2-core EPYC), but such a row rounds otherwise than the row a prompt computes
  at its position (measured: every decoded position of SmolLM2 and Qwen
  Coder 0.5B, bf16 and fp32), so generated tokens stayed out of the prefix
  cache. Padding a lone row's call to the piece's key count is not enough
  either: with fewer query rows than a piece (SmolLM2's 3), the kernel rounds
  otherwise again. Pieces make a decode step up to 9% dearer at contexts of
  300-2,000, a 5-token chain within 6% either way and a 12-node tree 4-12%
  dearer (two runs of benchmarks/attention_ab.py, benchmarks/README.md).

A tree sequence (``meta.tree_parents``, at most ``ROWWISE_MAX_QUERY`` tokens)
goes row by row: row ``i`` is computed in its piece's call at its depth's
position, over the context, its ancestors in depth order and itself, written
after the context in a keys buffer the tree's rows share (the context is
gathered once per layer). Those keys have the shape, layout and values of the
keys a chain row at the same depth reads, so every path of a tree gets
bitwise the logits of a chain forward of that path.

Short runs share calls. A run of at most ``BATCHED_MAX_PIECES`` pieces (a
decode row, a verified chain of up to ``PIECE + 1`` tokens) is computed with
every other such piece of the forward that reads the same number of keys, in
one call whose batch axis holds the pieces, each with its own staircase
(``PieceBatch``): 64 decoding streams were 64 calls per layer, each mostly
call overhead (SmolLM2, fp32, 2-core EPYC: attention and its glue were 60% of
a 485 ms step). The batch axis does not change a row: PyTorch's CPU kernel
computes each (batch, head) alone with blocks set by the query and key
counts, so a piece gives bitwise the same rows in a call of its own or beside
others (``tests/test_attention_backends.py`` checks it against each
sequence's prompt rows). That is what ``KEY_STEP`` is for: with key counts in
steps of a piece, streams whose contexts differ (all of them, in a server)
would rarely share a count; in steps of 32 keys, every stream within the same
32 positions does, for a few masked keys more per call (SmolLM2's shapes: 0.16
us a key against about 25 us a call, fp32, 2 cores). On other devices the
split of a kernel's work may follow the batch (FlashAttention's split-KV
heuristic does), so there every run keeps calls of its own until measured
there. Longer runs (prompts) stay per sequence: they gather their keys once
for all their pieces, and on a CPU the pieces of a run that read the same
number of keys (up to ``KEY_STEP / PIECE`` in a row) share a call, the keys
expanded along the batch axis rather than copied (``_attend_pieces``): a
1,024-token prompt was 256 calls per layer.

``prepare`` gathers each sequence's cached K/V slots (and a tree row's own
slots), groups the short runs' pieces and builds the mask once per forward;
every layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.attention.base import AttentionMetadata
from tandem.tree_rows import covering_paths

# Most new tokens of a token tree (its rows are computed one by one), and of a run the linear layers take
# for a short one (``tandem.models.layers.RowBlocks``).
ROWWISE_MAX_QUERY = 16
PIECE = 4  # query rows (and the step of key counts) of one attention call; see the module doc
# Runs of at most this many pieces share batched calls with the other pieces of their key count (module doc); a
# longer run's pieces each gather its keys again there, so prompts go per sequence.
BATCHED_MAX_PIECES = 2
# A call reads keys in multiples of this (module doc): the pieces of streams within KEY_STEP positions of each
# other share a call. A multiple of PIECE.
KEY_STEP = 32
# Most keys one batched call gathers (its pieces x the keys each reads): past it a call's gather ran at a third
# of the speed per key (15.7 MB of fp32 SmolLM2 keys, 2-core EPYC), so a group of more pieces takes more calls.
MAX_GATHERED_KEYS = 8192


@dataclass(frozen=True, slots=True)
class TreePath:
    """One root-to-node path of a tree (``tandem.tree_rows.covering_paths``): attended as a chain."""

    slots: torch.Tensor  # [depth + 1] int64: the path's rows' flat cache slots, in depth order
    rows: torch.Tensor  # [new] int64: the rows it computes (its suffix from ``start``), in depth order
    start: int  # depth of the first of them


@dataclass(frozen=True, slots=True)
class TreeGather:
    """The flat cache slots a tree sequence's rows attend over: each row sees ``context`` then its path."""

    context: torch.Tensor  # [ctx] int64, the cached context's slots by position
    paths: list[TreePath]  # together they compute every row once


@dataclass(frozen=True, slots=True)
class PieceBatch:
    """Pieces of short runs (any sequences) that read the same number of keys: one SDPA call, a piece per batch
    element."""

    keys: int  # keys each piece's call reads (``_keys_read``)
    kv_slots: torch.Tensor  # [count * keys] int64: each piece's sequence's first ``keys`` flat slots, in turn
    ends: list[int]  # [count] each piece's end (the staircase a piece reads is by its end)
    tokens: torch.Tensor  # [r] int64: the forward's query rows these pieces compute
    places: torch.Tensor  # [r] int64: where each of those rows sits, piece * PIECE + its row in the piece
    count: int  # pieces


@dataclass(slots=True)
class SdpaState:
    kv_gather: torch.Tensor  # [num_seqs, max_kv] int64 flat cache slots (past a sequence's end: slot 0, masked)
    piece_batches: list[PieceBatch]  # the short runs' pieces, by key count (``batch_short_runs``)
    long_runs: list[tuple[int, int]]  # (sequence, its first query row): chains computed per sequence
    # [PIECE, max_kv + KEY_STEP] additive mask: row r of the piece ending at e sees key k iff k <= e - PIECE + r,
    # as the columns [max_kv - e, max_kv - e + _keys_read(e)) of this staircase (``_piece_mask``)
    staircase: torch.Tensor
    # tree sequence index -> the flat slots its rows attend over (``tree_row_gathers``)
    tree_gathers: dict[int, TreeGather]
    # pieces of different runs (``batch_short_runs``) and a run's pieces of one key count (``_attend_pieces``)
    # share calls: on a CPU only (module doc)
    batched: bool
    # query heads per KV head -> [PIECE * G, max_kv + KEY_STEP] the staircase's rows each repeated G times
    # (``_attend_pieces``' grouped query rows), made by the first layer that needs it
    grouped_staircases: dict[int, torch.Tensor] = field(default_factory=dict)
    # (index in piece_batches, G) -> that call's mask (``_batch_mask``), made by the first layer that needs it
    batch_masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)


class SdpaAttention:
    name = "sdpa"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def prepare(self, meta: AttentionMetadata) -> SdpaState:
        device = meta.slot_mapping.device
        bs = meta.block_size
        # Every row reads the keys up to the end of its piece, rounded up to a KEY_STEP (module doc).
        max_kv = max(_keys_read(_pieces_end(c + q)) for c, q in zip(meta.context_lens, meta.query_lens))
        positions = torch.arange(max_kv, device=device)  # [max_kv]
        blocks = meta.block_tables.to(torch.int64)  # [num_seqs, max_blocks]
        block_idx = torch.clamp(positions // bs, max=blocks.shape[1] - 1)  # [max_kv]
        slots = blocks[:, block_idx] * bs + positions % bs  # [num_seqs, max_kv]
        valid = positions[None, :] < meta.seq_lens_k.to(device=device, dtype=torch.int64)[:, None]
        kv_gather = torch.where(valid, slots, torch.zeros_like(slots))
        # Row r, key column c: visible iff c <= max_kv - PIECE + r (a piece's own diagonal block last); KEY_STEP
        # columns more, all masked, for the keys a call reads past its piece's end.
        columns = torch.arange(max_kv + KEY_STEP, device=device)  # [max_kv + KEY_STEP]
        visible = columns[None, :] <= torch.arange(PIECE, device=device)[:, None] + (max_kv - PIECE)
        staircase = torch.zeros(visible.shape, dtype=self.dtype, device=device)
        staircase.masked_fill_(~visible, torch.finfo(self.dtype).min)
        tree_gathers = {
            b: tree_row_gathers(kv_gather[b], ctx, parents)
            for b, (ctx, parents) in enumerate(zip(meta.context_lens, meta.tree_parents))
            if parents is not None
        }
        batched = device.type == "cpu"
        piece_batches, long_runs = batch_short_runs(meta, kv_gather, batched)
        return SdpaState(kv_gather, piece_batches, long_runs, staircase, tree_gathers, batched)

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
        group = query.shape[1] // flat_k.shape[1]  # query heads per KV head
        staircase = _grouped_staircase(state, group)  # [PIECE * G, max_kv + KEY_STEP]
        if not state.piece_batches and not state.tree_gathers:  # long runs alone (prompts): their pieces in order
            pieces = [p for b, token in state.long_runs
                      for p in self._long_run(query, b, token, meta, state, flat_k, flat_v, staircase, scale)]
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        out = torch.empty_like(query)  # [num_tokens, H, D]: every row is written by one of the three below
        for index, batch in enumerate(state.piece_batches):
            mask = _batch_mask(state, index, staircase, group)
            out.index_copy_(0, batch.tokens, _attend_batch(query, batch, flat_k, flat_v, mask, scale))
        for b, token in state.long_runs:
            rows = self._long_run(query, b, token, meta, state, flat_k, flat_v, staircase, scale)
            out[token : token + meta.query_lens[b]] = rows[0] if len(rows) == 1 else torch.cat(rows)
        token = 0
        for b, qlen in enumerate(meta.query_lens):
            tree = state.tree_gathers.get(b)
            if tree is not None:
                out[token : token + qlen] = _attend_tree(query[token : token + qlen], tree, flat_k, flat_v,
                                                         staircase, scale, state.batched)[0]
            token += qlen
        return out

    @staticmethod
    def _long_run(
        query: torch.Tensor, b: int, token: int, meta: AttentionMetadata, state: SdpaState,
        flat_k: torch.Tensor, flat_v: torch.Tensor, staircase: torch.Tensor, scale: float,
    ) -> list[torch.Tensor]:  # [rows of a piece, H, D] each, in order
        """Sequence ``b``'s chain run, its keys gathered once for all its pieces."""
        ctx, qlen = meta.context_lens[b], meta.query_lens[b]
        gather = state.kv_gather[b, : _keys_read(_pieces_end(ctx + qlen))]
        keys = flat_k.index_select(0, gather).transpose(0, 1)[None]  # [1, Hkv, keys, D]
        values = flat_v.index_select(0, gather).transpose(0, 1)[None]  # [1, Hkv, keys, D]
        return _attend_pieces(query[token : token + qlen], ctx, keys, values, staircase, scale, state.batched)


def batch_short_runs(
    meta: AttentionMetadata, kv_gather: torch.Tensor, batched: bool,
) -> tuple[list[PieceBatch], list[tuple[int, int]]]:
    """The forward's chain runs split in two: the pieces of its short runs (at most ``BATCHED_MAX_PIECES``) of
    sequences that share a key count with another sequence, grouped by that count; and the other runs, as
    (sequence, first query row), each computed on its own (one gather for all its pieces and no index copies: a
    lone decode row pays only its masked keys). With ``batched`` False every chain run is computed on its own."""
    # sequence -> its pieces: (keys read, the piece's end, its first query row, rows, the first's place in the piece)
    short: dict[int, list[tuple[int, int, int, int, int]]] = {}
    run_starts: dict[int, int] = {}  # chain sequence -> its first query row
    token = 0
    for b, (ctx, qlen, parents) in enumerate(zip(meta.context_lens, meta.query_lens, meta.tree_parents)):
        num_pieces = (_pieces_end(ctx + qlen) - ctx // PIECE * PIECE) // PIECE
        if parents is None:
            run_starts[b] = token
        if parents is None and batched and num_pieces <= BATCHED_MAX_PIECES:
            start, end = ctx, ctx + qlen
            while start < end:
                base = start // PIECE * PIECE
                stop = min(end, base + PIECE)
                short.setdefault(b, []).append(
                    (_keys_read(base + PIECE), base + PIECE, token + start - ctx, stop - start, start - base))
                start = stop
        token += qlen
    readers: dict[int, set[int]] = {}  # keys read -> the sequences with a piece that reads that many
    for b, pieces in short.items():
        for keys, *_ in pieces:
            readers.setdefault(keys, set()).add(b)
    # keys read -> its calls, each (sequences, piece ends, tokens, places)
    groups: dict[int, list[tuple[list[int], list[int], list[int], list[int]]]] = {}
    batched_runs = set()
    for b, pieces in short.items():
        if all(len(readers[keys]) == 1 for keys, *_ in pieces):
            continue  # nobody to share a call with
        batched_runs.add(b)
        for keys, piece_end, first, rows, offset in pieces:
            calls = groups.setdefault(keys, [])
            if not calls or len(calls[-1][0]) * keys >= MAX_GATHERED_KEYS:
                calls.append(([], [], [], []))
            sequences, ends, tokens, places = calls[-1]
            first_place = len(sequences) * PIECE + offset
            sequences.append(b)
            ends.append(piece_end)
            tokens.extend(range(first, first + rows))
            places.extend(range(first_place, first_place + rows))
    long_runs = [(b, start) for b, start in run_starts.items() if b not in batched_runs]
    device = kv_gather.device
    batches = [
        PieceBatch(keys, kv_gather[sequences, :keys].reshape(-1), ends,
                   torch.tensor(tokens, dtype=torch.int64, device=device),
                   torch.tensor(places, dtype=torch.int64, device=device), len(sequences))
        for keys, calls in groups.items()
        for sequences, ends, tokens, places in calls
    ]
    return batches, long_runs


def _attend_batch(
    query: torch.Tensor,  # [num_tokens, H, D], the forward's queries
    batch: PieceBatch,
    flat_k: torch.Tensor,  # [slots, Hkv, D]
    flat_v: torch.Tensor,  # [slots, Hkv, D]
    mask: torch.Tensor,  # [PIECE * G, keys] or [count, 1, PIECE * G, keys]: ``_batch_mask``
    scale: float,
) -> torch.Tensor:  # [r, H, D], the rows of ``batch.tokens`` in that order
    """``batch``'s pieces in one call: each is the call ``_attend_pieces`` makes for it, as one batch element
    (the same query rows, keys, mask and inner strides), so its rows are bitwise that call's (module doc)."""
    count, read = batch.count, batch.keys
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = flat_k.shape[1]
    group = num_heads // num_kv_heads
    keys = flat_k.index_select(0, batch.kv_slots).view(count, read, num_kv_heads, head_dim).transpose(1, 2)
    values = flat_v.index_select(0, batch.kv_slots).view(count, read, num_kv_heads, head_dim).transpose(1, 2)
    piece_rows = query.new_zeros(count * PIECE, num_heads, head_dim)  # [count * PIECE, H, D], zero rows unused
    piece_rows.index_copy_(0, batch.places, query.index_select(0, batch.tokens))
    # [count, PIECE, Hkv, G, D] -> [count, Hkv, PIECE * G, D]: KV head h's rows r * G + g, as in _attend_pieces
    grouped = piece_rows.view(count, PIECE, num_kv_heads, group, head_dim).transpose(1, 2).reshape(
        count, num_kv_heads, PIECE * group, head_dim)
    attended = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    pieces = attended.view(count, num_kv_heads, PIECE, group, head_dim).transpose(1, 2).reshape(
        count * PIECE, num_heads, head_dim)  # [count * PIECE, H, D]
    return pieces.index_select(0, batch.places)


def _pieces_end(length: int) -> int:
    """Keys the last piece of a run ending at ``length`` reads: ``length`` rounded up to a whole piece."""
    return -(-length // PIECE) * PIECE


def _batch_mask(state: SdpaState, index: int, staircase: torch.Tensor, group: int) -> torch.Tensor:
    """The mask of ``state.piece_batches[index]``'s call: ``[PIECE * G, keys]`` when its pieces end together, else
    ``[count, 1, PIECE * G, keys]``, each piece's own; made once per forward, every layer reads the same."""
    mask = state.batch_masks.get((index, group))
    if mask is None:
        ends = state.piece_batches[index].ends
        if all(end == ends[0] for end in ends):
            mask = _piece_mask(staircase, ends[0])
        else:
            mask = torch.stack([_piece_mask(staircase, end) for end in ends])[:, None]
        state.batch_masks[(index, group)] = mask
    return mask


def _keys_read(end: int) -> int:
    """Keys the call of a piece ending at ``end`` reads: ``end`` rounded up to a multiple of ``KEY_STEP``."""
    return -(-end // KEY_STEP) * KEY_STEP


def _piece_mask(staircase: torch.Tensor, end: int) -> torch.Tensor:  # [PIECE * G, _keys_read(end)]
    """The mask of the piece ending at ``end`` (from the grouped ``staircase`` ``[PIECE * G, max_kv + KEY_STEP]``):
    row r * G + g sees the keys up to ``end - PIECE + r``."""
    start = staircase.shape[1] - KEY_STEP - end
    return staircase[:, start : start + _keys_read(end)]


def _last_pieces_masks(staircase: torch.Tensor, end: int, count: int) -> torch.Tensor:
    """The masks of the ``count`` pieces ending at ``end``, ``end - PIECE``, ... (all reading ``_keys_read(end)``
    keys), last piece first: ``[count, 1, PIECE * G, keys]``, a view of the grouped ``staircase``. A piece's mask
    starts PIECE columns left of the next piece's (``_piece_mask``), so last first they are windows PIECE columns
    apart, which strides can express (first first would need a negative stride)."""
    read = _keys_read(end)
    first = (staircase.shape[1] - KEY_STEP - end) // PIECE  # the window of the piece ending at ``end``
    return staircase.unfold(1, read, PIECE)[:, first : first + count].transpose(0, 1)[:, None]


def _grouped_staircase(state: SdpaState, group: int) -> torch.Tensor:  # [PIECE * G, max_kv + KEY_STEP]
    """The staircase with each row repeated once per query head of a KV head (G = ``group``; made once
    per forward)."""
    grouped = state.grouped_staircases.get(group)
    if grouped is None:
        grouped = state.grouped_staircases[group] = state.staircase.repeat_interleave(group, dim=0)
    return grouped


def _attend_pieces(
    rows: torch.Tensor,  # [q, H, D], the run's queries, at positions ctx .. ctx + q - 1
    ctx: int,
    keys: torch.Tensor,  # [1, Hkv, >= keys read by the last piece, D], the sequence's keys (past its end: masked)
    values: torch.Tensor,  # [1, Hkv, >= keys read by the last piece, D]
    staircase: torch.Tensor,  # [PIECE * G, max_kv + KEY_STEP]: ``_grouped_staircase``
    scale: float,
    batched: bool,
) -> list[torch.Tensor]:  # [rows of a group of pieces, H, D] each, in order
    """The run in fixed pieces (module doc): piece j is PIECE query rows over (j + 1) * PIECE keys rounded up
    to a multiple of KEY_STEP.

    The G query heads that share a KV head are that head's query rows (in KV head h's rows,
    row r * G + g is piece row r of query head h * G + g), so one call per piece reads K/V as
    they are:
    ``enable_gqa`` copied a piece's keys and values G times per call, which made prompt attention
    a quarter of a 391-token prefill of Qwen2.5-Coder-1.5B (G = 6) on a 2-core EPYC.

    With ``batched`` (on a CPU), the run's consecutive pieces that read the same number of keys (up to
    KEY_STEP / PIECE of them) go in one call, a piece per batch element over the same keys (expanded, not
    copied), each with its own staircase: each is bitwise its call alone (module doc), and a 1,024-token
    prompt makes 32 calls per layer rather than 256 (SmolLM2, fp32, 2-core EPYC: attention was a quarter
    of its prefill, mostly per-call cost). Otherwise each piece keeps its call.
    """
    out, start, end = [], ctx, ctx + rows.shape[0]
    num_heads, num_kv_heads, head_dim = rows.shape[1], keys.shape[1], rows.shape[2]
    group = num_heads // num_kv_heads
    while start < end:
        base = start // PIECE * PIECE
        read = _keys_read(base + PIECE)
        # every piece from here that ends by ``read`` reads ``read`` keys
        pieces_end = min(_pieces_end(end), read) if batched else base + PIECE
        count = (pieces_end - base) // PIECE
        stop = min(end, pieces_end)
        piece_rows = rows.new_zeros(count, PIECE, num_heads, head_dim)  # zero rows unused
        piece_rows.view(count * PIECE, num_heads, head_dim)[start - base:stop - base] = rows[start - ctx:stop - ctx]
        if count == 1:  # [PIECE * G, read]: row r * G + g sees keys <= base + r
            mask = _piece_mask(staircase, base + PIECE)
        else:  # batch element i is piece count - 1 - i: then its masks are a view (``_last_pieces_masks``)
            piece_rows = piece_rows.flip(0)
            mask = _last_pieces_masks(staircase, pieces_end, count)
        # [count, PIECE, Hkv, G, D] -> [count, Hkv, PIECE * G, D]
        query = piece_rows.view(count, PIECE, num_kv_heads, group, head_dim).transpose(1, 2).reshape(
            count, num_kv_heads, PIECE * group, head_dim)
        attended = F.scaled_dot_product_attention(
            query, keys[:, :, :read].expand(count, -1, -1, -1), values[:, :, :read].expand(count, -1, -1, -1),
            attn_mask=mask, scale=scale,
        )  # [count, Hkv, PIECE * G, D]
        if count > 1:
            attended = attended.flip(0)  # pieces in order again
        pieces = attended.view(count, num_kv_heads, PIECE, group, head_dim).transpose(1, 2).reshape(
            count * PIECE, num_heads, head_dim)  # [count * PIECE, H, D]
        out.append(pieces[start - base:stop - base])
        start = stop
    return out


def _attend_tree(
    rows: torch.Tensor,  # [q, H, D]
    tree: TreeGather,
    flat_k: torch.Tensor,  # [slots, Hkv, D]
    flat_v: torch.Tensor,  # [slots, Hkv, D]
    staircase: torch.Tensor,  # [PIECE * G, max_kv]: ``_grouped_staircase``
    scale: float,
    batched: bool,
) -> list[torch.Tensor]:  # [q, H, D], rows in order
    """A tree's rows, each over the keys a chain of its path would see, at its depth's position.

    The tree is covered by root-to-node paths (``covering_paths``); each path is attended as the
    chain it is, in pieces, computing the rows no earlier path did. So a row is computed in its
    piece's call at position ``ctx + depth`` over the context, its ancestors and itself: what a
    chain of its path computes there (module doc), and a deep tree of few branches pays about a
    chain's calls rather than one piece per row (EAGLE-2's 12-node shape: 6 paths, 8-9 calls).
    The context is gathered once into the head of a buffer and each path writes its slots after
    it: gathering the whole context per row made the gathers a fifth of a 12-node verify of
    Qwen2.5-Coder-1.5B at a context of 1,000 (2-core EPYC). The buffer ``[keys its last piece reads,
    Hkv, D]`` sliced and transposed has the inner strides of a chain's keys (only the stride of
    the size-1 batch axis differs, as it does between chains of different lengths), so each call
    is the chain's call, bit for bit. Keys past a path (up to its last piece's end) are masked:
    an earlier path's or zeros, never uninitialised memory (a NaN would survive the mask). Paths
    reuse the buffer one after another: each SDPA call has read it before the next path overwrites
    it (at once on a CPU, in stream order on a GPU).
    """
    ctx = tree.context.shape[0]
    deepest = max(path.slots.shape[0] for path in tree.paths)
    length = _keys_read(_pieces_end(ctx + deepest))  # what the deepest row's call reads
    key_buffer = flat_k.new_empty(length, *flat_k.shape[1:])  # [length, Hkv, D]
    value_buffer = flat_v.new_empty(length, *flat_v.shape[1:])
    key_buffer[ctx:].zero_()
    value_buffer[ctx:].zero_()
    torch.index_select(flat_k, 0, tree.context, out=key_buffer[:ctx])
    torch.index_select(flat_v, 0, tree.context, out=value_buffer[:ctx])
    keys = key_buffer.transpose(0, 1)[None]  # [1, Hkv, length, D]
    values = value_buffer.transpose(0, 1)[None]
    out = torch.empty_like(rows)  # [q, H, D]
    for path in tree.paths:
        end = ctx + path.slots.shape[0]
        torch.index_select(flat_k, 0, path.slots, out=key_buffer[ctx:end])
        torch.index_select(flat_v, 0, path.slots, out=value_buffer[ctx:end])
        pieces = _attend_pieces(rows.index_select(0, path.rows), ctx + path.start, keys, values, staircase, scale,
                                batched)
        out.index_copy_(0, path.rows, pieces[0] if len(pieces) == 1 else torch.cat(pieces))
    return [out]


def tree_row_gathers(seq_slots: torch.Tensor, ctx: int, parents: list[int]) -> TreeGather:
    """A tree's flat slots: its context's, and those of the root-to-node paths that cover it.

    ``seq_slots`` ``[>= ctx + q]`` are the sequence's flat slots by position; new token ``i``
    was written at position ``ctx + i``.
    """
    if len(parents) > ROWWISE_MAX_QUERY:
        raise ValueError(f"a tree of {len(parents)} new tokens: at most {ROWWISE_MAX_QUERY} are attended by path")
    device = seq_slots.device
    paths = []
    for path, start in covering_paths(parents):
        at = torch.tensor(path, dtype=torch.int64, device=device)  # [depth + 1] rows
        paths.append(TreePath(seq_slots[at + ctx], at[start:], start))
    return TreeGather(seq_slots[:ctx], paths)
