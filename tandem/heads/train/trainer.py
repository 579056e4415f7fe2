"""The optimisation loop: AdamW on the heads, batches and learning rate fixed by the step, checkpoints.

Loss: per Medusa head / EAGLE step, the cross-entropy of its guess against the target's
label (labels outside the draft vocabulary ignored), weighted ``STEP_DECAY ** i``: a
later guess only counts when every earlier one was accepted, so the early ones matter
more (Medusa's 0.8 per head). Learning rate: linear warm-up, then a cosine down to a
tenth. Gradients clipped to norm 1. Master weights are fp32; the forward and backward
run under bf16 autocast where ``use_bf16`` (``compute_dtype``: on GPUs, and on CPUs where timed faster).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tandem.heads.train.checkpoints import Checkpoint, CheckpointDir
from tandem.heads.train.heap import release_freed_memory
from tandem.heads.train.shards import BatchPlan, FeatureShards
from tandem.heads.train.summary import Objective
from tandem.heads.train.vocab import OUT_OF_VOCAB
from tandem.model_convert import SILENT, Progress

STEP_DECAY = 0.8
MIN_LR_FRACTION = 0.1
CLIP_NORM = 1.0
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.01


@dataclass(frozen=True, slots=True)
class LoopSettings:
    steps: int
    lr: float
    warmup_steps: int
    checkpoint_every: int
    use_bf16: bool
    device: torch.device


def learning_rate(step: int, settings: LoopSettings) -> float:
    warm = min(1.0, (step + 1) / settings.warmup_steps) if settings.warmup_steps else 1.0
    progress = step / max(1, settings.steps - 1)
    cosine = MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))
    return settings.lr * warm * cosine


def objective_loss(predictions: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    total = predictions[0][0].new_zeros(())
    for i, (logits, labels) in enumerate(predictions):
        if bool((labels != OUT_OF_VOCAB).any()):  # a batch where no label is sayable adds nothing
            total = total + STEP_DECAY**i * F.cross_entropy(logits.float(), labels, ignore_index=OUT_OF_VOCAB)
    return total


def train_loop(
    module: torch.nn.Module,
    objective: Objective,
    shards: FeatureShards,
    plan: BatchPlan,
    settings: LoopSettings,
    checkpoints: CheckpointDir,
    run: dict[str, Any],
    history: dict[str, Any],
    *,
    resume: bool,
    strict: bool = True,
    progress: Progress = SILENT,
    stop_after: int | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Train ``module`` to ``settings.steps`` (or ``stop_after`` steps, as an interrupted run would);
    returns ``history`` with the losses and the seconds spent (over every resumed part) added.

    ``resume``: continue from the newest checkpoint (``strict``: refuse one of another run; else start over).
    """
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    start = 0
    found = checkpoints.latest(run, strict) if resume else None
    if found is not None:
        module.load_state_dict(found.heads)
        optimizer.load_state_dict(found.optimizer)
        start, history = found.step, found.history
        log(f"resuming from step {start} ({checkpoints.path(start)})")
    else:
        checkpoints.clear()
    history.setdefault("loss", [])
    seconds_before, loop_started = history.get("training_seconds", 0.0), time.perf_counter()
    end = settings.steps if stop_after is None else min(settings.steps, stop_after)
    progress.stage("training", settings.steps, "step")
    progress.advance(start)
    window_loss, window_tokens, window_steps, window_started = 0.0, 0, 0, time.perf_counter()
    for step in range(start, end):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, settings)
        batch = shards.batch(plan.batch(step)).to(settings.device)
        with torch.autocast(settings.device.type, dtype=torch.bfloat16, enabled=settings.use_bf16):
            loss = objective_loss(objective.predictions(batch))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)
        optimizer.step()
        window_loss += float(loss.detach())
        window_tokens += batch.num_tokens
        del batch, loss
        release_freed_memory()  # tandem.heads.train.heap: fragmented free memory grew ~60 MB a step
        window_steps += 1
        progress.advance(1)
        done = step + 1
        if done % settings.checkpoint_every == 0 or done == end:
            seconds = time.perf_counter() - window_started
            mean = window_loss / window_steps
            history["loss"].append({"step": done, "loss": round(mean, 4)})
            history["training_seconds"] = seconds_before + time.perf_counter() - loop_started
            log(f"step {done}/{settings.steps}: loss {mean:.3f}, {window_tokens / max(seconds, 1e-9):.0f} tokens/s")
            checkpoints.save(Checkpoint(done, module.state_dict(), optimizer.state_dict(), run, history))
            window_loss, window_tokens, window_steps, window_started = 0.0, 0, 0, time.perf_counter()
    return history
