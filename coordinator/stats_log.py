"""One log line every few seconds while the coordinator works: throughput, queue, KV use and speculation.

A `tandem up` or `tandem serve coordinator` log otherwise says nothing while requests run, and
Prometheus is not always at hand. As vLLM's engine logs its throughput and its speculation's
acceptance every few seconds, the coordinator logs, every ``--log-stats-interval`` seconds
while requests run or since the last line something finished, one line such as::

    stats: 4 running, 1 waiting; 38.9 tokens/s generated; 12 requests finished (3204 prompt tokens,
    35.2% found in the prefix cache); target KV 41.0% used; speculation 2.31 tokens a round, 65.5% of
    412 drafted tokens accepted

(one line in the log), then one line more once all is idle, and nothing while it stays idle.
Every figure is over the interval and read from the coordinator's metrics: tokens as they are
streamed (``tandem_coordinator_generated_tokens``), requests and their prompts as they finish,
the speculation's rounds as they are verified (``tandem.rpc.vllm_metrics``), and the KV use is
the target fleet's as its last Info poll said.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import Any

from tandem.rpc.metrics import CoordinatorMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Totals:
    """The metrics' running totals at one moment."""

    generated: float = 0.0  # tokens streamed to clients
    finished: float = 0.0  # requests ended, however
    prompt_tokens: float = 0.0  # of the requests finished
    prefix_queries: float = 0.0  # prompt tokens looked up in the target's prefix cache
    prefix_hits: float = 0.0  # of which found there
    rounds: float = 0.0  # speculation rounds that verified proposed tokens
    drafted: float = 0.0
    accepted: float = 0.0

    @classmethod
    def read(cls, metrics: CoordinatorMetrics) -> Totals:
        vllm = metrics.vllm
        return cls(_total(metrics.generated_tokens), _total(vllm.request_success), _total(vllm.prompt_tokens),
                   _total(vllm.prefix_queries), _total(vllm.prefix_hits), _total(vllm.spec_drafts),
                   _total(vllm.spec_draft_tokens), _total(vllm.spec_accepted_tokens))


class StatsLog:
    """Logs ``line()`` every ``interval_s`` (``run``). ``kv_usage``: the target fleet's share of KV blocks in use."""

    def __init__(self, metrics: CoordinatorMetrics, kv_usage: Callable[[], float], interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.kv_usage = kv_usage
        self.interval_s = interval_s
        self._clock = clock
        self._last = Totals.read(metrics)
        self._last_at = clock()
        self._quiet = True  # the last line said all was idle (or none was logged yet)

    def line(self) -> str | None:
        """The interval's line; None while all stays idle (no request in flight, nothing finished since)."""
        now, totals = self._clock(), Totals.read(self.metrics)
        seconds = max(now - self._last_at, 1e-9)
        waiting = self.metrics.vllm.waiting.value
        running = max(0, self.metrics.vllm.in_flight - waiting)
        delta = Totals(*(new - old for new, old in zip(astuple(totals), astuple(self._last))))
        self._last, self._last_at = totals, now
        idle = running == 0 and waiting == 0 and delta == Totals()
        if idle and self._quiet:
            return None
        self._quiet = idle
        parts = [f"{running} running, {waiting} waiting", f"{delta.generated / seconds:.1f} tokens/s generated"]
        if delta.finished:
            found = (f", {100 * delta.prefix_hits / delta.prefix_queries:.1f}% found in the prefix cache"
                     if delta.prefix_queries else "")
            requests = "request" if delta.finished == 1 else "requests"
            parts.append(f"{delta.finished:.0f} {requests} finished ({delta.prompt_tokens:.0f} prompt tokens{found})")
        parts.append(f"target KV {100 * self.kv_usage():.1f}% used")
        if delta.rounds:
            parts.append(f"speculation {1 + delta.accepted / delta.rounds:.2f} tokens a round, "
                         f"{100 * delta.accepted / delta.drafted:.1f}% of {delta.drafted:.0f} drafted tokens accepted")
        return "stats: " + "; ".join(parts)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            text = self.line()
            if text is not None:
                log.info(text)


def _total(counter: Any) -> float:
    """A counter's value summed over its labels (its ``_total`` samples)."""
    return sum(sample.value for family in counter.collect() for sample in family.samples
               if sample.name.endswith("_total"))

