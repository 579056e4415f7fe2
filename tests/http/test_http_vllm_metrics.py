"""vLLM's metric names on the coordinator's /metrics, over the scripted target (tests/http/harness.py): what a
Kubernetes inference gateway reads to route (the queue, the KV cache's use) and what vLLM's dashboards read,
moving with the requests the coordinator serves."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.coordinator.inprocess import tiny_tokenizer
from tests.http.harness import MODEL, http_coordinator
from tests.http.test_http_api import client, run

ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


async def scrape(running) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as session, session.get(running.root + "/metrics") as reply:
        text = await reply.text()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("vllm:") and s.labels.get("model_name") == MODEL}


async def until(running, check, timeout_s: float = 30.0):
    """The scrape once ``check`` holds of it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        samples = await scrape(running)
        if check(samples):
            return samples
        assert loop.time() < deadline, samples
        await asyncio.sleep(0.02)


def gauges(samples) -> tuple[float, float]:
    return samples[("vllm:num_requests_running", ())], samples[("vllm:num_requests_waiting", ())]


def test_the_queue_and_the_running_requests_follow_a_request_refused_for_room_then_served(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, info={"total_blocks": 200, "free_blocks": 50}) as running:
            samples = await scrape(running)
            assert gauges(samples) == (0, 0)
            assert samples[("vllm:kv_cache_usage_perc", ())] == 0.75  # 150 of the target's 200 blocks in use
            running.target.full_prefills = 10 ** 6  # every Prefill refused as a full pool refuses it
            waiting = asyncio.create_task(client(running).chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=3, temperature=0))
            await until(running, lambda s: gauges(s) == (0, 1))  # it waits for room: queued, not running
            running.target.gate.clear()  # once admitted, its rounds wait at the target's Verify
            running.target.full_prefills = 0
            await until(running, lambda s: gauges(s) == (1, 0) and running.target.calls["Verify"] > 0)
            running.target.gate.set()
            reply = await waiting
            assert reply.choices[0].finish_reason == "length"
            queued = reply.choices[0].model_extra["tandem"]["queue_s"]
            assert queued > 0  # the reply says how long it waited for room
            samples = await until(running, lambda s: gauges(s) == (0, 0))
            assert samples[("vllm:request_success_total", (("finished_reason", "length"),))] == 1
            assert samples[("vllm:generation_tokens_total", ())] == 3
            assert samples[("vllm:prompt_tokens_total", ())] == len(running.target.prompts[-1])
            assert samples[("vllm:time_to_first_token_seconds_count", ())] == 1
            assert samples[("vllm:inter_token_latency_seconds_count", ())] == 2
            assert samples[("vllm:e2e_request_latency_seconds_count", ())] == 1
            assert samples[("vllm:request_queue_time_seconds_count", ())] == 1
            assert abs(samples[("vllm:request_queue_time_seconds_sum", ())] - queued) < 1e-6
            assert samples[("vllm:num_preemptions_total", ())] == 0  # refused prompts held nothing
    run(go())
