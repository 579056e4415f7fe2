"""Paged KV cache: one preallocated block pool, a block table per sequence.

The pool is allocated once at start-up, so a worker's memory is fixed and
admission control is a matter of counting free blocks. A sequence's KV is
``length`` slots spread over its blocks in order; rollback is just moving
``length`` back and returning whole blocks past the new end to the pool, the
same trick as a preallocated buffer written by position (gpt-fast), which is
why rollback is exact: a slot past ``length`` is never read.

Prefix caching (``prefix_caching``, see ``tandem.block_pool``): a full block of
committed tokens is registered under the hash of its content once the caller
``commit``s it, stays cached after its sequence ends, and a new sequence whose
prompt starts with the same blocks takes them back (``reuse_prefix``) instead of
computing them. Shared blocks are never written: a sequence only appends after
its end, and a rollback that ends inside a shared block first gives the
sequence a private copy of it (copy on write), so a rejected draft token can
never reach a block another sequence reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from tandem.block_pool import BlockPool, PrefixCacheStats, block_chain, block_hash
from tandem.errors import KVCacheExhaustedError, UnknownSequenceError

SeqId = Hashable
_HELD, _NEW, _WAITING = 0, 1, 2  # ``PagedKVCache.admit``'s kinds of call (the order of two that arrived together)


@dataclass(slots=True)
class SequenceBlocks:
    """Where one sequence's KV lives: its blocks in order and how many slots are filled."""

    block_ids: list[int] = field(default_factory=list)
    length: int = 0
    # Content hashes of its first len(hashes) blocks: full blocks of committed tokens (a chain, see block_hash).
    hashes: list[bytes] = field(default_factory=list)


class PagedKVCache:
    """A fixed pool of KV blocks shared by all sequences of one model.

    Tensors (per layer ``l``): ``key[l]`` and ``value[l]`` are
    ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        prefix_caching: bool = False,
        salt: bytes = b"",
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.salt = salt  # the root of every hash chain: what else makes the KV (model, dtype, ...)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.key = torch.zeros(shape, dtype=dtype, device=device)  # [L, blocks, block_size, Hkv, D]
        self.value = torch.zeros(shape, dtype=dtype, device=device)  # [L, blocks, block_size, Hkv, D]
        self.pool = BlockPool(num_blocks, prefix_caching)
        self._seqs: dict[SeqId, SequenceBlocks] = {}

    # ----- bookkeeping -------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks new KV can take: free ones, and cached ones no sequence holds (evicted when taken)."""
        return self.pool.available

    @property
    def prefix_caching(self) -> bool:
        return self.pool.prefix_caching

    def prefix_stats(self) -> PrefixCacheStats:
        return self.pool.snapshot()

    def blocks_needed(self, length: int) -> int:
        return -(-length // self.block_size)

    def has_sequence(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def sequence(self, seq_id: SeqId) -> SequenceBlocks:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence {seq_id!r}") from None

    def length(self, seq_id: SeqId) -> int:
        return self.sequence(seq_id).length

    def sequences(self) -> list[SeqId]:
        return list(self._seqs)

    def extra_blocks_for(self, seq_id: SeqId, num_new: int) -> int:
        """Blocks that appending ``num_new`` slots to ``seq_id`` would take from the pool."""
        seq = self._seqs.get(seq_id)
        have, length = (len(seq.block_ids), seq.length) if seq else (0, 0)
        return max(0, self.blocks_needed(length + num_new) - have)

    def admit(self, lengths: list[tuple[SeqId, int]],
              growth: Callable[[SeqId, int], int] | None = None,
              rank: Callable[[SeqId], int] | None = None,
              waiting: Sequence[tuple[int, float, int]] = (),
              arrival: Callable[[SeqId], float] | None = None,
              keeps_place: Callable[[SeqId], bool] | None = None) -> list[int | None]:
        """Which of a batch's calls the pool can hold, changing nothing.

        ``lengths``: per call, its sequence and the KV length it will have after the batch.
        A call's need is the blocks at that length minus the blocks it holds now (negative for
        one that rolls back more than it appends). Calls that give blocks back count first; then
        the calls of sequences the pool holds, oldest first (the order they entered it), so that
        when the pool runs short it is the youngest that are refused (and preempted by their
        coordinator): the oldest go on, finish and free their blocks, where refusing whichever
        call came last let every sequence in turn lose its KV and be computed again (vLLM too
        preempts its newest requests first). Calls that start a sequence come last, in order (of arrival),
        and each only while every held sequence (its own included) keeps free the blocks it would
        take to grow ``growth(seq_id, length)`` more tokens (its next rounds, or the rest of its
        answer): a burst of new prompts would fill that room, and every running sequence would be
        refused the round after.

        ``rank``: each sequence's priority, lower first (vLLM's request ``priority``; None: all 0, the order
        above). Calls are taken rank by rank, each rank in the order above: a new sequence goes before the
        growth of sequences ranked below it, and keeps free only the growth of those ranked as high or higher,
        so that where the pool runs short the lowest ranked are refused (and preempted) first. ``waiting``:
        (rank, arrival, blocks) of prompts refused for room that keep their place (``tandem.rpc.room_waits``):
        each takes what is free, up to its blocks, after the held sequences of its own rank and before the new
        ones of its rank that arrived after it (``arrival``: when each new sequence's request arrived; None:
        new sequences go in call order, and waiting prompts after them) and everything ranked below, which are
        then refused (as they start, or as they grow) until the waiting prompt fits. ``keeps_place``: whether a
        new sequence refused here keeps its place; one that does sets aside what is free, up to its blocks and its
        room, as a waiting prompt does, against the calls after it in this batch (a prompt held at the worker asks
        in every batch, where its place would otherwise never apply).
        Returns, per call, None when admitted, else the blocks it would need beyond what is left.
        """
        rank_of = rank or (lambda seq_id: 0)
        age = {seq_id: i for i, seq_id in enumerate(self._seqs)}  # (dicts keep insertion order)
        need = [self.blocks_needed(length) - (len(self._seqs[s].block_ids) if s in self._seqs else 0)
                for s, length in lengths]
        free = self.num_free_blocks + sum(-n for n in need if n <= 0)
        held_growth = [(rank_of(seq_id),
                        self._growth(seq.length, len(seq.block_ids), growth(seq_id, seq.length) if growth else 0))
                       for seq_id, seq in self._seqs.items()]
        refused: list[int | None] = [None] * len(lengths)
        # (rank, held or not, order, kind, call index or waiting index): held sequences oldest first, then new ones
        # and waiting prompts by arrival (new ones first where two arrived together)
        def arrived(seq_id: SeqId) -> float:
            return arrival(seq_id) if arrival is not None else 0.0

        order = sorted([(rank_of(s), 0, age[s], _HELD, i) if s in age else (rank_of(s), 1, arrived(s), _NEW, i)
                        for i, (s, _) in enumerate(lengths)]
                       + [(r, 1, when if arrival is not None else math.inf, _WAITING, j)
                          for j, (r, when, _) in enumerate(waiting)])
        reserved = 0  # the growth of the new sequences admitted so far (all ranked as high as the next, or higher)
        held_reserve: dict[int, int] = {}  # rank -> the growth of the held sequences ranked as high or higher
        for r, _, _, kind, i in order:
            if kind == _WAITING:
                free -= min(free, waiting[i][2])
                continue
            seq_id, length = lengths[i]
            n = need[i]
            if kind == _HELD:
                if n <= free:
                    free -= max(0, n)
                else:
                    refused[i] = n - free
                continue
            if r not in held_reserve:  # (once per rank: a burst of new prompts would sum it per prompt)
                held_reserve[r] = sum(g for held_rank, g in held_growth if held_rank <= r)
            reserve = reserved + held_reserve[r]
            own = self._growth(length, self.blocks_needed(length), growth(seq_id, length) if growth else 0)
            if n + reserve + own <= free:
                free -= n
                reserved += own
            else:
                refused[i] = n + reserve + own - free
                if keeps_place is not None and keeps_place(seq_id):
                    free -= min(free, n + own)
        return refused

    def _growth(self, length: int, blocks: int, tokens: int) -> int:
        """Blocks a sequence of ``length`` tokens in ``blocks`` blocks takes to grow ``tokens`` more."""
        return max(0, self.blocks_needed(length + tokens) - blocks) if tokens else 0

    def can_append(self, appends: dict[SeqId, int]) -> bool:
        return sum(self.extra_blocks_for(s, n) for s, n in appends.items()) <= self.pool.available

    # ----- mutation ----------------------------------------------------
    def append_slots(self, appends: dict[SeqId, int]) -> dict[SeqId, torch.Tensor]:
        """Grow each sequence by ``n`` slots and return their flat slot ids.

        All or nothing: when the pool cannot hold every append, raise before
        changing anything, so a refused batch leaves every sequence as it was.
        Returns per sequence a ``[n]`` int64 tensor of flat slot indices
        (``block_id * block_size + offset``) for the new tokens.
        """
        needed = sum(self.extra_blocks_for(s, n) for s, n in appends.items())
        if needed > self.pool.available:
            raise KVCacheExhaustedError(
                f"KV cache exhausted: the batch needs {needed} more blocks of {self.block_size} tokens, "
                f"{self.pool.available} of {self.num_blocks} are free"
            )
        slots: dict[SeqId, torch.Tensor] = {}
        for seq_id, num_new in appends.items():
            seq = self._seqs.setdefault(seq_id, SequenceBlocks())
            for _ in range(self.blocks_needed(seq.length + num_new) - len(seq.block_ids)):
                seq.block_ids.append(self.pool.allocate())
            positions = torch.arange(seq.length, seq.length + num_new)
            blocks = torch.tensor(seq.block_ids, dtype=torch.int64)
            slots[seq_id] = blocks[positions // self.block_size] * self.block_size + positions % self.block_size
            seq.length += num_new
        return slots

    def rollback(self, seq_id: SeqId, length: int, move: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                 ) -> None:
        """Shorten a sequence to ``length`` slots, returning blocks past the end to the pool.

        When the new end falls inside a block that is cached (registered), the sequence will write
        into it next: a block only it holds leaves the index; a block others hold too is replaced
        by a private copy (``move``: how slots are copied, ``self.move`` unless the caller copies
        on every tensor-parallel rank), so no other sequence ever sees the change.
        """
        seq = self.sequence(seq_id)
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot roll sequence {seq_id!r} back to {length}: it holds {seq.length} tokens")
        keep = self.blocks_needed(length)
        full = length // self.block_size
        shared = keep > full and self.pool.refcount(seq.block_ids[full]) > 1  # the end lands in a shared block
        if shared and self.pool.available + len(seq.block_ids) - keep == 0:
            raise KVCacheExhaustedError(f"KV cache exhausted: rolling {seq_id!r} back into a shared block needs a "
                                        "free block for its private copy")
        for block in reversed(seq.block_ids[keep:]):
            self.pool.release(block)
        del seq.block_ids[keep:]
        del seq.hashes[full:]
        seq.length = length
        if keep == full:
            return
        block = seq.block_ids[full]
        if shared:
            copy = self.pool.allocate()
            offsets = torch.arange(length - full * self.block_size)
            (move or self.move)(block * self.block_size + offsets, copy * self.block_size + offsets)
            self.pool.release(block)
            seq.block_ids[full] = copy
        elif self.pool.is_registered(block):
            self.pool.unregister(block)

    def release(self, seq_id: SeqId) -> None:
        """Free every block of a sequence (cached ones stay cached); unknown ids raise UnknownSequenceError."""
        seq = self.sequence(seq_id)
        for block in reversed(seq.block_ids):
            self.pool.release(block)
        del self._seqs[seq_id]

    # ----- the prefix cache ----------------------------------------------
    def reuse_prefix(self, seq_id: SeqId, tokens: Sequence[int], limit: int) -> int:
        """Start a new sequence on the longest run of cached blocks that ``tokens`` begins with, at most
        ``limit`` tokens of it; the tokens reused (a multiple of the block size, 0 on a miss or with
        prefix caching off). Counts the lookup in the hit rate."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} exists: only a new sequence starts on a cached prefix")
        if not self.prefix_caching:
            return 0
        seq = SequenceBlocks()
        for block, content in self._cached_blocks(tokens, limit):
            self.pool.hold(block)
            seq.block_ids.append(block)
            seq.hashes.append(content)
        seq.length = len(seq.block_ids) * self.block_size
        self._seqs[seq_id] = seq
        self.pool.count_lookup(len(tokens), seq.length)
        return seq.length

    def cached_prefix_len(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` a new sequence would take from the cache now (full blocks),
        changing nothing: no block held, no lookup counted. A reader on another thread than the one that
        computes sees the index as it stands (each lookup is one dict read): a hint, not a promise."""
        return sum(1 for _ in self._cached_blocks(tokens, len(tokens))) * self.block_size

    def _cached_blocks(self, tokens: Sequence[int], limit: int) -> Iterator[tuple[int, bytes]]:
        """(block, content hash) of the cached full blocks ``tokens[:limit]`` begins with, in order."""
        if not self.prefix_caching:
            return
        for content in block_chain(tokens[:limit], self.block_size, self.salt):
            block = self.pool.lookup(content)
            if block is None:
                return
            yield block, content

    def commit(self, seq_id: SeqId, tokens: Sequence[int], upto: int) -> None:
        """``tokens[:upto]`` are committed (verified) and their KV is in place: register the full blocks
        among them that are not yet, so that later prompts may reuse them. ``tokens`` holds at least
        the sequence's tokens up to ``upto``; only the new full blocks are hashed."""
        if not self.prefix_caching:
            return
        seq = self.sequence(seq_id)
        full = min(upto, seq.length, len(tokens)) // self.block_size
        parent = seq.hashes[-1] if seq.hashes else self.salt
        for i in range(len(seq.hashes), full):
            content = block_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            self.pool.register(seq.block_ids[i], content)
            seq.hashes.append(content)
            parent = content

    def block_table(self, seq_ids: list[SeqId], device: torch.device | str = "cpu") -> torch.Tensor:
        """``[num_seqs, max_blocks]`` int32 block ids, padded with 0 (never read past a sequence's length)."""
        rows = [self.sequence(s).block_ids for s in seq_ids]
        width = max((len(r) for r in rows), default=0) or 1
        table = torch.zeros((len(rows), width), dtype=torch.int32)
        for i, row in enumerate(rows):
            table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        return table.to(device)

    def slots(self, seq_id: SeqId, positions: list[int]) -> torch.Tensor:
        """The flat slots ``[len(positions)]`` int64 of a sequence's filled ``positions``."""
        seq = self.sequence(seq_id)
        outside = [p for p in positions if not 0 <= p < seq.length]
        if outside:
            raise ValueError(f"sequence {seq_id!r} holds {seq.length} tokens: no position {outside[0]}")
        pos = torch.tensor(positions, dtype=torch.int64)
        blocks = torch.tensor(seq.block_ids, dtype=torch.int64)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of flat slots ``src`` ``[n]`` to slots ``dst`` ``[n]``, in every layer.

        Every source is read before any destination is written, so moves whose sources
        and destinations overlap (a path shifted down over its own rows) are safe.
        """
        if src.shape != dst.shape or src.dim() != 1:
            raise ValueError(f"a KV move needs two [n] slot lists, got {tuple(src.shape)} and {tuple(dst.shape)}")
        src, dst = src.to(self.key.device), dst.to(self.key.device)
        for pool in (self.key, self.value):
            flat = pool.view(pool.shape[0], -1, *pool.shape[-2:])  # [L, slots, Hkv, D]
            flat.index_copy_(1, dst, flat.index_select(1, src))

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new keys/values ``[num_tokens, Hkv, D]`` at flat ``slots`` ``[num_tokens]`` of a layer."""
        flat_k = self.key[layer].view(-1, *self.key.shape[-2:])
        flat_v = self.value[layer].view(-1, *self.value.shape[-2:])
        flat_k.index_copy_(0, slots, key)
        flat_v.index_copy_(0, slots, value)
