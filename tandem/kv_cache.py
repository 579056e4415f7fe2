"""Paged KV cache: one preallocated block pool, a block table per sequence.

The pool is allocated once at start-up, so a worker's memory is fixed and
admission control is a matter of counting free blocks. A sequence's KV is
``length`` slots spread over its blocks in order; rollback is just moving
``length`` back and returning whole blocks past the new end to the pool, the
same trick as a preallocated buffer written by position (gpt-fast), which is
why rollback is exact: a slot past ``length`` is never read.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from tandem.errors import KVCacheExhaustedError, UnknownSequenceError

SeqId = Hashable


@dataclass(slots=True)
class SequenceBlocks:
    """Where one sequence's KV lives: its blocks in order and how many slots are filled."""

    block_ids: list[int] = field(default_factory=list)
    length: int = 0


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
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.key = torch.zeros(shape, dtype=dtype, device=device)  # [L, blocks, block_size, Hkv, D]
        self.value = torch.zeros(shape, dtype=dtype, device=device)  # [L, blocks, block_size, Hkv, D]
        # Lowest ids handed out first so that a fresh pool's layout is predictable in tests.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._seqs: dict[SeqId, SequenceBlocks] = {}

    # ----- bookkeeping -------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

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

    def admit(self, lengths: list[tuple[SeqId, int]]) -> list[int | None]:
        """Which of a batch's calls the pool can hold, changing nothing.

        ``lengths``: per call, its sequence and the KV length it will have after the batch.
        A call's need is the blocks at that length minus the blocks it holds now (negative for
        one that rolls back more than it appends). Calls that give blocks back count first,
        then the others in order. Returns, per call, None when admitted, else the blocks it
        would need beyond what is left.
        """
        need = [self.blocks_needed(length) - (len(self._seqs[s].block_ids) if s in self._seqs else 0)
                for s, length in lengths]
        free = self.num_free_blocks + sum(-n for n in need if n <= 0)
        refused: list[int | None] = []
        for n in need:
            if n <= free:
                free -= max(0, n)
                refused.append(None)
            else:
                refused.append(n - free)
        return refused

    def can_append(self, appends: dict[SeqId, int]) -> bool:
        return sum(self.extra_blocks_for(s, n) for s, n in appends.items()) <= len(self._free)

    # ----- mutation ----------------------------------------------------
    def append_slots(self, appends: dict[SeqId, int]) -> dict[SeqId, torch.Tensor]:
        """Grow each sequence by ``n`` slots and return their flat slot ids.

        All or nothing: when the pool cannot hold every append, raise before
        changing anything, so a refused batch leaves every sequence as it was.
        Returns per sequence a ``[n]`` int64 tensor of flat slot indices
        (``block_id * block_size + offset``) for the new tokens.
        """
        needed = sum(self.extra_blocks_for(s, n) for s, n in appends.items())
        if needed > len(self._free):
            raise KVCacheExhaustedError(
                f"KV cache exhausted: the batch needs {needed} more blocks of {self.block_size} tokens, "
                f"{len(self._free)} of {self.num_blocks} are free"
            )
        slots: dict[SeqId, torch.Tensor] = {}
        for seq_id, num_new in appends.items():
            seq = self._seqs.setdefault(seq_id, SequenceBlocks())
            for _ in range(self.blocks_needed(seq.length + num_new) - len(seq.block_ids)):
                seq.block_ids.append(self._free.pop())
            positions = torch.arange(seq.length, seq.length + num_new)
            blocks = torch.tensor(seq.block_ids, dtype=torch.int64)
            slots[seq_id] = blocks[positions // self.block_size] * self.block_size + positions % self.block_size
            seq.length += num_new
        return slots

    def rollback(self, seq_id: SeqId, length: int) -> None:
        """Shorten a sequence to ``length`` slots, returning blocks past the end to the pool."""
        seq = self.sequence(seq_id)
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot roll sequence {seq_id!r} back to {length}: it holds {seq.length} tokens")
        keep = self.blocks_needed(length)
        self._free.extend(reversed(seq.block_ids[keep:]))
        del seq.block_ids[keep:]
        seq.length = length

    def release(self, seq_id: SeqId) -> None:
        """Free every block of a sequence; unknown ids raise UnknownSequenceError."""
        seq = self.sequence(seq_id)
        self._free.extend(reversed(seq.block_ids))
        del self._seqs[seq_id]

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
