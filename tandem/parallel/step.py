"""The per-step protocol: what rank 0 tells the other ranks before each forward pass.

Rank 0 owns scheduling and all KV bookkeeping (block allocation, rollback, release);
the other ranks hold only their heads' KV tensors, and a ``ForwardBatch`` carries
everything they need: the bookkeeping is already resolved into slot ids and block
tables. A step is two broadcasts from rank 0 on the control group:

    header   int64 [5]: kind, T (new tokens), B (sequences), M (block-table width), R (logit rows)
    payload  int64 [3T + 2B + B*M + R], FORWARD only, concatenated in this order:
             input_ids [T] | positions [T] | slot_mapping [T] | query_lens [B] | context_lens [B]
             | block_tables [B*M] (row-major) | logit_rows [R]

STOP (a header alone) ends the other ranks' loop. Tensors travel on ``device``: the CPU
for gloo, the rank's own GPU for NCCL.

Rank 0 waits at most ``timeout`` for each broadcast: a gloo send waits for the receiver
to ask for the data, so a frozen rank would otherwise hold rank 0 for the group's
timeout, which is practically infinite (the other ranks wait in it while rank 0 idles).
"""

from __future__ import annotations

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


def send_forward(batch: ForwardBatch, group: Any, device: torch.device, timeout: timedelta) -> None:
    """Rank 0: announce ``batch``; every other rank then runs the same forward pass on its shard."""
    num_seqs, width = batch.block_tables.shape
    header = torch.tensor(  # [5]
        [StepKind.FORWARD, batch.input_ids.numel(), num_seqs, width, batch.logit_rows.numel()], dtype=torch.int64
    )
    payload = torch.cat([  # [3T + 2B + B*M + R]
        batch.input_ids, batch.positions, batch.slot_mapping,
        torch.tensor(batch.query_lens, dtype=torch.int64), torch.tensor(batch.context_lens, dtype=torch.int64),
        batch.block_tables.to(torch.int64).flatten(), batch.logit_rows,
    ])
    _send(header.to(device), group, timeout)
    _send(payload.to(device), group, timeout)


def send_stop(group: Any, device: torch.device, timeout: timedelta) -> None:
    """Rank 0: the other ranks leave their loop."""
    _send(torch.tensor([StepKind.STOP, 0, 0, 0, 0], dtype=torch.int64, device=device), group, timeout)


def _send(tensor: torch.Tensor, group: Any, timeout: timedelta) -> None:
    dist.broadcast(tensor, src=0, group=group, async_op=True).wait(timeout=timeout)


def receive(group: Any, device: torch.device) -> ForwardBatch | None:
    """Ranks 1..N-1: wait for rank 0's next step; None when it is STOP."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)  # [5]
    dist.broadcast(header, src=0, group=group)
    kind, num_tokens, num_seqs, width, num_rows = header.tolist()
    if kind == StepKind.STOP:
        return None
    if kind != StepKind.FORWARD:
        raise RuntimeError(f"unknown tensor-parallel step kind {kind}")
    payload = torch.empty(3 * num_tokens + 2 * num_seqs + num_seqs * width + num_rows, dtype=torch.int64,
                          device=device)
    dist.broadcast(payload, src=0, group=group)
    ids, positions, slots, query_lens, context_lens, tables, rows = payload.cpu().split(
        [num_tokens, num_tokens, num_tokens, num_seqs, num_seqs, num_seqs * width, num_rows]
    )
    return ForwardBatch(
        input_ids=ids, positions=positions, slot_mapping=slots,
        block_tables=tables.view(num_seqs, width).to(torch.int32),
        query_lens=query_lens.tolist(), context_lens=context_lens.tolist(), logit_rows=rows,
    )
