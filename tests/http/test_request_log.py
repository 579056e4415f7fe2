"""--log-requests (coordinator/request_log.py): a line per request as it ends, over the scripted target
(tests/http/harness.py): its id, outcome, tokens, speculation, replicas and waits; never its text."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.coordinator.inprocess import tiny_tokenizer
from tests.http.harness import MODEL, http_coordinator
from tests.http.test_http_api import client

SECRET = "the launch codes are 0000"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "coordinator.service" and
            r.getMessage().startswith("request ")]


def test_each_request_is_one_line_as_it_ends_and_its_text_is_never_logged(tokenizer, caplog):
    async def go():
        async with http_coordinator(tokenizer, log_requests=True) as running:
            api = client(running)
            reply = await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SECRET}],
                                                      max_tokens=3, temperature=0,
                                                      extra_headers={"X-Request-Id": "req-logged-1"})
            assert reply.choices[0].finish_reason == "length"
            running.target.full_prefills = 1  # the next one waits once for room in a full pool
            await api.completions.create(model=MODEL, prompt=SECRET, max_tokens=2,
                                         extra_headers={"X-Request-Id": "req-logged-2"})

    with caplog.at_level(logging.INFO, logger="coordinator.service"):
        asyncio.run(go())
    first, second = logged(caplog)
    assert first.startswith("request req-logged-1 ok (length): ") and "3 generated in " in first
    assert "; on 127.0.0.1:" in first and "; method " in first and "waits for room" not in first
    assert second.startswith("request req-logged-2 ok (length): ") and "1 waits for room" in second
    assert SECRET not in caplog.text


def test_without_the_flag_nothing_is_logged_per_request(tokenizer, caplog):
    async def go():
        async with http_coordinator(tokenizer) as running:
            await client(running).completions.create(model=MODEL, prompt="hi", max_tokens=2)

    with caplog.at_level(logging.INFO, logger="coordinator.service"):
        asyncio.run(go())
    assert logged(caplog) == []


def test_a_failed_request_says_why_with_its_moves_and_waits():
    from coordinator.request_log import request_line
    from tandem.sampling_params import SamplingParams
    from tandem.spec.request import RequestState, StopConditions

    state = RequestState([1, 2, 3], SamplingParams(), StopConditions(8))
    state.stats.target_moves, state.stats.preemptions, state.stats.queue_s = 2, 1, 1.5
    line = request_line("r-9", "ngram", state, "error", "10.0.0.1:50052", "", "WorkerUnavailableError: gone")
    assert line.startswith("request r-9 error: 3 prompt tokens (0 from the prefix cache), 0 generated in ")
    assert "; method ngram, 0 rounds; on 10.0.0.1:50052; 2 moves, 1 preemptions, 1.50 s queued; " in line
    assert line.endswith("; error: WorkerUnavailableError: gone")
