"""The per-step protocol: what rank 0 tells the other ranks before each forward pass or KV move.

Rank 0 owns scheduling and all KV bookkeeping (block allocation, rollback, release);
the other ranks hold only their heads' KV tensors, and a ``ForwardBatch`` carries
everything they need: the bookkeeping is already resolved into slot ids and block
tables. A step is two broadcasts from rank 0 on the control group:

    header   int64 [5]: kind, T (new tokens), B (sequences), M (block-table width), R (logit rows)
    payload  int64 [4T + 3B + B*M + R], FORWARD only, concatenated in this order:
             input_ids [T] | positions [T] | slot_mapping [T] | parents [T] | query_lens [B]
             | context_lens [B] | prompt_runs [B] (0/1) | block_tables [B*M] (row-major) | logit_rows [R]

MOVE_KV copies K/V between slots in every layer (``ModelEngine.keep_path`` after a tree
forward): every rank holds its own heads' KV, so every rank must copy. Its header is
kind, N (slots moved), 0, 0, 0 and its payload ``src slots [N] | dst slots [N]``.

STOP (a header alone) ends the other ranks' loop. Tensors travel on ``device``: the CPU
for gloo, the rank's own GPU for NCCL.

Rank 0 waits at most ``timeout`` for each broadcast: a gloo send waits for the receiver
to ask for the data, so a frozen rank would otherwise hold rank 0 for the group's
timeout, which is practically infinite (the other ranks wait in it while rank 0 idles).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from tandem.engine import ForwardBatch

HEADER_LEN = 5


class StepKind(IntEnum):
    FORWARD = 1
    STOP = 2
    MOVE_KV = 3


@dataclass(slots=True)
class KVMove:
    """Copy the K/V of flat slots ``src`` to ``dst``, in every layer (``PagedKVCache.move``)."""

    src: torch.Tensor  # [N] int64
    dst: torch.Tensor  # [N] int64


def encode_forward(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:  # header [5], payload
    """A forward step as the two int64 tensors rank 0 broadcasts (module doc)."""
    num_seqs, width = batch.block_tables.shape
    header = torch.tensor(  # [5]
        [StepKind.FORWARD, batch.input_ids.numel(), num_seqs, width, batch.logit_rows.numel()], dtype=torch.int64
    )
    payload = torch.cat([  # [4T + 3B + B*M + R]
        batch.input_ids, batch.positions, batch.slot_mapping, batch.parents,
        torch.tensor(batch.query_lens, dtype=torch.int64), torch.tensor(batch.context_lens, dtype=torch.int64),
        torch.tensor(batch.prompt_runs, dtype=torch.int64),
        batch.block_tables.to(torch.int64).flatten(), batch.logit_rows,
    ])
    return header, payload


def payload_len(num_tokens: int, num_seqs: int, width: int, num_rows: int) -> int:
    return 4 * num_tokens + 3 * num_seqs + num_seqs * width + num_rows


def decode_forward(payload: torch.Tensor, num_tokens: int, num_seqs: int, width: int, num_rows: int) -> ForwardBatch:
    """The ``ForwardBatch`` a payload of ``encode_forward`` carries (header sizes given)."""
    ids, positions, slots, parents, query_lens, context_lens, prompt_runs, tables, rows = payload.cpu().split(
        [num_tokens, num_tokens, num_tokens, num_tokens, num_seqs, num_seqs, num_seqs, num_seqs * width, num_rows]
    )
    return ForwardBatch(
        input_ids=ids, positions=positions, slot_mapping=slots,
        block_tables=tables.view(num_seqs, width).to(torch.int32),
        query_lens=query_lens.tolist(), context_lens=context_lens.tolist(), logit_rows=rows, parents=parents,
        prompt_runs=[bool(p) for p in prompt_runs.tolist()],
    )


def send_forward(batch: ForwardBatch, group: Any, device: torch.device, timeout: timedelta) -> None:
    """Rank 0: announce ``batch``; every other rank then runs the same forward pass on its shard."""
    header, payload = encode_forward(batch)
    _send(header.to(device), group, timeout)
    _send(payload.to(device), group, timeout)


def send_move(move: KVMove, group: Any, device: torch.device, timeout: timedelta) -> None:
    """Rank 0: every other rank copies the same slots of its own KV."""
    num_slots = move.src.numel()
    _send(torch.tensor([StepKind.MOVE_KV, num_slots, 0, 0, 0], dtype=torch.int64, device=device), group, timeout)
    _send(torch.cat([move.src, move.dst]).to(device=device, dtype=torch.int64), group, timeout)  # [2N]


def send_stop(group: Any, device: torch.device, timeout: timedelta) -> None:
    """Rank 0: the other ranks leave their loop."""
    _send(torch.tensor([StepKind.STOP, 0, 0, 0, 0], dtype=torch.int64, device=device), group, timeout)


def _send(tensor: torch.Tensor, group: Any, timeout: timedelta) -> None:
    dist.broadcast(tensor, src=0, group=group, async_op=True).wait(timeout=timeout)


def receive(group: Any, device: torch.device) -> ForwardBatch | KVMove | None:
    """Ranks 1..N-1: wait for rank 0's next step; None when it is STOP."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)  # [5]
    dist.broadcast(header, src=0, group=group)
    kind, *sizes = header.tolist()
    if kind == StepKind.STOP:
        return None
    if kind == StepKind.FORWARD:
        return _receive_forward(group, device, *sizes)
    if kind == StepKind.MOVE_KV:
        return _receive_move(group, device, sizes[0])
    raise RuntimeError(f"unknown tensor-parallel step kind {kind}")


def _receive_forward(group: Any, device: torch.device, num_tokens: int, num_seqs: int, width: int,
                     num_rows: int) -> ForwardBatch:
    payload = torch.empty(payload_len(num_tokens, num_seqs, width, num_rows), dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0, group=group)
    return decode_forward(payload, num_tokens, num_seqs, width, num_rows)


def _receive_move(group: Any, device: torch.device, num_slots: int) -> KVMove:
    payload = torch.empty(2 * num_slots, dtype=torch.int64, device=device)  # [2N]
    dist.broadcast(payload, src=0, group=group)
    return KVMove(payload[:num_slots], payload[num_slots:])  # on the device: the rank's KV is there
