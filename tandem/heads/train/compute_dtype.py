"""fp32 or bf16 autocast for a training run: chosen by ``--train-dtype``, or timed on this machine (auto).

On a GPU with bf16, autocast. On a CPU the answer is the machine's, not the instruction
set's: on a 2-core Xeon (Emerald Rapids, avx512_bf16) an EAGLE step of 1024 tokens took
10.6 s in fp32 and 16.0 s under bf16 autocast (Medusa 5.6 s against 9.6 s), while on a
2-core Zen 5 EPYC (avx512_bf16) an EAGLE step of about 2,000 tokens took 8.5-9.1 s in
fp32 and 3.4-3.5 s under autocast, with the same torch. So auto times one forward and
backward of a real batch each way, after one untimed warm-up each, and keeps the faster:
about 20 s for a Qwen-1.5B head on 2 cores, against a run of an hour. Timing changes
nothing: gradients are dropped and no optimizer step is taken, so the run's weights do not
depend on the choice's timing, only its numerics on the choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tandem.heads.train.shards import Batch
from tandem.heads.train.summary import Objective
from tandem.heads.train.trainer import objective_loss


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    use_bf16: bool
    reason: str  # for the log and the heads' provenance
    seconds: dict[str, float] | None = None  # measured forward + backward per mode, when timed


def choose_compute_dtype(train_dtype: str, device: torch.device, module: torch.nn.Module,
                         objective: Objective, batch: Batch) -> DtypeChoice:
    if train_dtype != "auto":
        return DtypeChoice(train_dtype == "bfloat16", f"--train-dtype {train_dtype}")
    if device.type == "cuda":
        supported = torch.cuda.is_bf16_supported()
        return DtypeChoice(supported, "auto: bf16 autocast on a GPU that has it" if supported
                           else "auto: this GPU lacks bf16")
    batch = batch.to(device)
    seconds = {"float32": _time_step(module, objective, batch, device, False),
               "bfloat16": _time_step(module, objective, batch, device, True)}
    faster = seconds["bfloat16"] < seconds["float32"]
    timing = f"one step of {batch.num_tokens} tokens: fp32 {seconds['float32']:.2f} s, " \
             f"bf16 autocast {seconds['bfloat16']:.2f} s"
    return DtypeChoice(faster, f"auto: {timing}", seconds)


def _time_step(module: torch.nn.Module, objective: Objective, batch: Batch, device: torch.device,
               use_bf16: bool) -> float:  # seconds of the second of two forward + backward passes
    elapsed = 0.0
    for _ in range(2):
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            loss = objective_loss(objective.predictions(batch))
        loss.backward()
        elapsed = time.perf_counter() - started
        module.zero_grad(set_to_none=True)
    return elapsed
