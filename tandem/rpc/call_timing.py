"""What a worker call went through in the batcher: its wait, its batch steps, their size and time.

A traced call (``tandem.rpc.traced_calls``) puts a ``CallTiming`` in the
context of the task that handles it; ``Batcher.submit``, awaited in that task,
finds it there and the batcher fills it in as the call's steps run. An untraced
call has none, and the batcher records nothing for it.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass(slots=True)
class CallTiming:
    submitted_at: float = field(default_factory=time.perf_counter)  # perf_counter when it was queued
    first_step_at: float | None = None  # when its first batch step began; None: none ran yet
    steps: int = 0  # batch steps it took part in (a long prompt's chunks take several; a held call's tries too)
    compute_s: float = 0.0  # those steps' time on the model thread, in all (shared with the step's other calls)
    step_calls: int = 0  # calls in its last step, itself included
    step_tokens: int = 0  # that step's cost, in the batcher's token budget's unit
    held: int = 0  # times it was refused for room and held for a later step

    def step(self, started: float, seconds: float, calls: int, tokens: int) -> None:
        if self.first_step_at is None:
            self.first_step_at = started
        self.steps += 1
        self.compute_s += seconds
        self.step_calls, self.step_tokens = calls, tokens

    def attributes(self) -> dict[str, float | int]:
        """Span attributes: how long it queued before its first step, and what its steps were."""
        queued = (self.first_step_at if self.first_step_at is not None else time.perf_counter()) - self.submitted_at
        return {"tandem.batch.queued_s": round(queued, 6), "tandem.batch.steps": self.steps,
                "tandem.batch.compute_s": round(self.compute_s, 6), "tandem.batch.calls": self.step_calls,
                "tandem.batch.tokens": self.step_tokens, "tandem.batch.held": self.held}


# The traced call the running task handles (None: untraced). A context variable belongs to its asyncio task.
CURRENT_CALL: ContextVar[CallTiming | None] = ContextVar("tandem_call_timing", default=None)
