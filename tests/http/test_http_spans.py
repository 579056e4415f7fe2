"""Request spans through the HTTP API (tandem.tracing), over the scripted target (tests/http/harness.py): a choice
of each of n under the caller's traceparent header, and choices that were placed but never ran ended too."""

from __future__ import annotations

import asyncio

import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from tandem.errors import InvalidRequestError
from tandem.tracing import Tracing
from tests.coordinator.inprocess import tiny_tokenizer
from tests.http.harness import MODEL, http_coordinator
from tests.http.test_http_api import client

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
HEADERS = {"traceparent": f"00-{CALLER_TRACE}-00f067aa0ba902b7-01"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def traced(running) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    running.server.tracing = Tracing.with_provider(provider)
    return exporter


def test_each_choice_is_a_span_under_the_callers_trace(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            exporter = traced(running)
            await client(running).completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2,
                                                     extra_headers=HEADERS)
            return exporter.get_finished_spans()

    spans = asyncio.run(go())
    assert len(spans) == 2 and all(f"{s.context.trace_id:032x}" == CALLER_TRACE for s in spans)
    assert {s.attributes["tandem.outcome"] for s in spans} == {"ok"}


def test_choices_placed_before_another_was_refused_end_their_spans_as_refused(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            exporter = traced(running)
            start, started = running.service.start, []

            def second_refused(request, remaining, *trace):
                if started:
                    raise InvalidRequestError("no room for a second choice")
                started.append(start(request, remaining, *trace))
                return started[-1]

            running.service.start = second_refused
            with pytest.raises(openai.BadRequestError):
                await client(running).completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2,
                                                         extra_headers=HEADERS)
            return exporter.get_finished_spans(), running.target.calls["Prefill"]

    spans, prefills = asyncio.run(go())
    (span,) = spans  # the first choice's: placed, never run
    assert prefills == 0 and span.attributes["tandem.outcome"] == "refused"
    assert span.status.status_code == StatusCode.ERROR
    assert "another choice of its request was refused: no room for a second choice" in span.status.description
