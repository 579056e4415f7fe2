"""How good the heads are: top-1 and top-3 accuracy against the target's own labels, on held-back data.

Per Medusa head / EAGLE step, over every row that has a label: a hit when the target's
label is the heads' first guess (top-1) or among their first three (top-3). A label
outside the draft vocabulary is a miss (the heads could never say it). Teacher forced,
as trained: EAGLE's step ``j`` is measured after ``j - 1`` correct tokens, so top-1 of
step ``j`` is roughly the chance a draft token at depth ``j`` is accepted given the ones
before it were.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from tandem.heads.train.shards import Batch

TOP_K = (1, 3)


class Objective(Protocol):
    names: list[str]

    def predictions(self, batch: Batch) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


@torch.no_grad()
def accuracy(objective: Objective, batches: Iterable[Batch], device: torch.device,
             autocast: bool) -> list[dict[str, Any]]:
    """``[{"name", "rows", "top1", "top3"}]``, one per head or step."""
    hits = torch.zeros(len(objective.names), len(TOP_K), dtype=torch.int64)
    rows = torch.zeros(len(objective.names), dtype=torch.int64)
    for batch in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            predictions = objective.predictions(batch.to(device))
        for i, (logits, labels) in enumerate(predictions):
            guesses = logits.topk(max(TOP_K), dim=-1).indices  # [R, 3], draft ids
            found = guesses == labels[:, None]  # out-of-vocabulary labels (-100) never match
            for j, k in enumerate(TOP_K):
                hits[i, j] += int(found[:, :k].any(dim=-1).sum())
            rows[i] += labels.numel()
    return [
        {"name": name, "rows": int(rows[i]),
         **{f"top{k}": round(float(hits[i, j]) / max(1, int(rows[i])), 4) for j, k in enumerate(TOP_K)}}
        for i, name in enumerate(objective.names)
    ]


def table(trained: list[dict[str, Any]], untrained: list[dict[str, Any]]) -> str:
    """The accuracy as a plain-text table, the untrained heads' beside the trained ones'."""
    lines = [f"{'':8}  {'top-1':>6}  {'top-3':>6}   {'untrained top-1':>15}  {'top-3':>6}  {'rows':>7}"]
    for now, before in zip(trained, untrained):
        lines.append(f"{now['name']:8}  {now['top1']:6.1%}  {now['top3']:6.1%}   "
                     f"{before['top1']:15.1%}  {before['top3']:6.1%}  {now['rows']:7d}")
    return "\n".join(lines)
