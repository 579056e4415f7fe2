"""Training checkpoints: the heads, the optimizer's state and the step, every N steps.

A run resumed from step ``s`` continues bit for bit: the weights and AdamW's moments are
stored exactly (fp32), the learning rate and the batches are functions of the step
(``tandem.heads.train.shards.BatchPlan``), and nothing else is random. A checkpoint
records the run it belongs to (``run``: the options and the features), so resuming a
run asked for differently is refused instead of silently mixing two.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.errors import InvalidRequestError

_NAME = re.compile(r"^step-(\d{8})\.pt$")
KEPT = 2  # the newest checkpoints kept; older ones go as new ones are written


@dataclass(slots=True)
class Checkpoint:
    step: int
    heads: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    run: dict[str, Any]
    history: dict[str, Any]  # what the run measured so far (the untrained heads' accuracy, losses)


class CheckpointDir:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := _NAME.match(p.name)))

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}.pt"

    def save(self, checkpoint: Checkpoint) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = self.directory / f".step-{checkpoint.step:08d}.partial"
        torch.save({"step": checkpoint.step, "heads": checkpoint.heads, "optimizer": checkpoint.optimizer,
                    "run": checkpoint.run, "history": checkpoint.history}, partial)
        os.replace(partial, self.path(checkpoint.step))  # a checkpoint is there whole or not at all
        for step in self.steps()[:-KEPT]:
            self.path(step).unlink(missing_ok=True)

    def latest(self, run: dict[str, Any], strict: bool = True) -> Checkpoint | None:
        """The newest checkpoint; one of another run is refused (naming what differs), or with
        ``strict`` False ignored (None: start over)."""
        steps = self.steps()
        if not steps:
            return None
        path = self.path(steps[-1])
        data = torch.load(path, map_location="cpu", weights_only=True)
        if data["run"] != run:
            if not strict:
                return None
            differs = sorted(k for k in set(run) | set(data["run"]) if run.get(k) != data["run"].get(k))
            raise InvalidRequestError(
                f"--resume: the checkpoint {path} belongs to a run with other settings ({', '.join(differs)}); "
                "run again with the same flags, or without --resume to start over"
            )
        return Checkpoint(data["step"], data["heads"], data["optimizer"], data["run"], data["history"])

    def clear(self) -> None:
        for step in self.steps():
            self.path(step).unlink(missing_ok=True)
