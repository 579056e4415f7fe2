"""The coordinator's stats line (coordinator/stats_log.py): what the interval's metrics say, quiet while idle."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry

from coordinator.stats_log import StatsLog
from tandem.config import CoordinatorConfig, ServerOptions
from tandem.errors import InvalidRequestError
from tandem.rpc.metrics import CoordinatorMetrics
from tandem.spec.request import GenerationStats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def finished_request(metrics: CoordinatorMetrics, prompt_tokens: int, generated: int, reused: int) -> None:
    stats = GenerationStats()
    stats.generated, stats.prompt_tokens_reused = generated, reused
    metrics.vllm.finished(stats, "ok", "length", prompt_tokens)


def test_a_busy_interval_says_what_ran_and_an_idle_one_is_said_once_then_nothing():
    metrics, clock = CoordinatorMetrics(CollectorRegistry()), Clock()
    usage = [0.25]
    stats = StatsLog(metrics, lambda: usage[0], interval_s=10, clock=clock)
    assert stats.line() is None  # nothing ran yet
    metrics.vllm.started()
    metrics.vllm.started()
    metrics.vllm.waiting.inc()  # one of them waits for room
    metrics.generated_tokens.inc(50)
    metrics.vllm.round(drafted=4, accepted=3)
    metrics.vllm.round(drafted=4, accepted=1)
    finished_request(metrics, prompt_tokens=200, generated=20, reused=50)
    clock.now += 10
    assert stats.line() == ("stats: 0 running, 1 waiting; 5.0 tokens/s generated; 1 request finished (200 prompt "
                            "tokens, 25.0% found in the prefix cache); target KV 25.0% used; speculation 3.00 tokens "
                            "a round, 50.0% of 8 drafted tokens accepted")
    metrics.vllm.waiting.dec()  # admitted: running now
    clock.now += 5
    assert stats.line() == "stats: 1 running, 0 waiting; 0.0 tokens/s generated; target KV 25.0% used"
    finished_request(metrics, prompt_tokens=10, generated=3, reused=0)
    metrics.generated_tokens.inc(3)
    clock.now += 10
    assert stats.line() == ("stats: 0 running, 0 waiting; 0.3 tokens/s generated; 1 request finished (10 prompt "
                            "tokens, 0.0% found in the prefix cache); target KV 25.0% used")
    clock.now += 10
    assert stats.line() == "stats: 0 running, 0 waiting; 0.0 tokens/s generated; target KV 25.0% used"  # idle now
    clock.now += 10
    assert stats.line() is None and stats.line() is None  # and quiet while it stays so


def test_the_lines_are_logged_every_interval(caplog):
    metrics = CoordinatorMetrics(CollectorRegistry())
    metrics.vllm.started()

    async def go():
        task = asyncio.create_task(StatsLog(metrics, lambda: 0.5, interval_s=0.05).run())
        await asyncio.sleep(0.18)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="coordinator.stats_log"):
        asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if r.name == "coordinator.stats_log"]
    assert len(lines) >= 2 and all(line.startswith("stats: 1 running, 0 waiting;") for line in lines)


@pytest.mark.parametrize("seconds", [-1, 0.5, 4000, float("nan")])
def test_a_stats_interval_out_of_range_is_refused_naming_the_flag(seconds, tmp_path):
    with pytest.raises(InvalidRequestError, match="--log-stats-interval must be 0"):
        CoordinatorConfig(server=ServerOptions(), tokenizer_dir=tmp_path, target_addrs=["127.0.0.1:1"],
                          log_stats_interval_s=seconds)
