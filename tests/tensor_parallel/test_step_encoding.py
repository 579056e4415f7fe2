"""The forward step rank 0 broadcasts (tandem/parallel/step.py): every field a follower rank needs survives."""

from __future__ import annotations

import torch

from tandem.engine import ForwardBatch
from tandem.parallel.step import StepKind, decode_forward, encode_forward, payload_len


def test_a_forward_step_round_trips_with_its_prompt_runs():
    batch = ForwardBatch(
        input_ids=torch.tensor([5, 6, 7, 8, 9, 10], dtype=torch.int64),  # a 3-token prompt chunk, a decode, a tree
        positions=torch.tensor([16, 17, 18, 40, 9, 10], dtype=torch.int64),
        slot_mapping=torch.tensor([64, 65, 66, 104, 137, 138], dtype=torch.int64),
        block_tables=torch.tensor([[4, 1, 0], [2, 6, 3], [8, 0, 0]], dtype=torch.int32),
        query_lens=[3, 1, 2],
        context_lens=[16, 40, 9],
        logit_rows=torch.tensor([2, 3, 4, 5], dtype=torch.int64),
        parents=torch.tensor([-1, 0, 1, -1, -1, -1], dtype=torch.int64),
        prompt_runs=[True, False, False],
    )
    header, payload = encode_forward(batch)
    kind, *sizes = header.tolist()
    assert kind == StepKind.FORWARD and payload.numel() == payload_len(*sizes)
    got = decode_forward(payload, *sizes)
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "logit_rows", "parents"):
        assert torch.equal(getattr(got, name), getattr(batch, name)), name
    assert (got.query_lens, got.context_lens, got.prompt_runs) == (batch.query_lens, batch.context_lens,
                                                                    batch.prompt_runs)
