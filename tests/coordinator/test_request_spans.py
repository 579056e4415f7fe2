"""A request's span on the coordinator (tandem.tracing, coordinator/request_spans.py): under the caller's trace, its
context on every worker call, the reply's figures as attributes, a failure as its status; in process, through the
real GenerationService and a fake target worker over gRPC, spans caught by OpenTelemetry's in-memory exporter."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from tandem.tracing import TRACEPARENT, Tracing
from tandem.v1 import generation_pb2
from tests.coordinator.inprocess import TOKEN, tiny_tokenizer, warm_coordinator

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER = (("traceparent", f"00-{CALLER_TRACE}-b7ad6b7169203331-01"),)
REQUEST = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[3, 4, 5]), request_id="r-1",
                                         stopping=generation_pb2.StoppingOptions(max_new_tokens=3))


def run(tmp_path, scenario):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def main():
        async with warm_coordinator(tiny_tokenizer(tmp_path)) as (coordinator, worker, stub):
            coordinator.server.tracing = Tracing.with_provider(provider)
            result = await scenario(coordinator, worker, stub)
            await coordinator.service.finish_releases(5)
            return result, worker

    result, worker = asyncio.run(main())
    return result, worker, exporter.get_finished_spans()


def test_a_request_s_span_carries_its_reply_and_its_context_reaches_every_worker_call(tmp_path):
    async def scenario(coordinator, worker, stub):
        return await stub.Generate(REQUEST, metadata=CALLER, timeout=10)

    reply, worker, spans = run(tmp_path, scenario)
    (span,) = spans
    assert f"{span.context.trace_id:032x}" == CALLER_TRACE and f"{span.parent.span_id:016x}" == "b7ad6b7169203331"
    assert list(reply.token_ids) == [TOKEN] * 3
    attributes = span.attributes
    assert attributes["gen_ai.request.id"] == "r-1" and attributes["gen_ai.request.model"] == "fake-target"
    assert attributes["gen_ai.usage.input_tokens"] == 3 and attributes["gen_ai.usage.output_tokens"] == 3
    assert attributes["gen_ai.request.max_tokens"] == 3 and attributes["tandem.outcome"] == "ok"
    assert tuple(attributes["gen_ai.response.finish_reasons"]) == ("length",)
    assert attributes["tandem.rounds"] == reply.stats.rounds and attributes["tandem.method"] == reply.stats.method
    assert [e.name for e in span.events] == ["first_token"]
    sent = f"00-{CALLER_TRACE}-{span.context.span_id:016x}-01"
    assert {method: heard.get(TRACEPARENT) for method, heard in worker.metadata.items()} == {
        "Prefill": sent, "Verify": sent, "Release": sent}  # the release, after the reply, too


def test_without_tracing_no_trace_context_is_sent_to_the_workers(tmp_path):
    async def main():
        async with warm_coordinator(tiny_tokenizer(tmp_path)) as (coordinator, worker, stub):
            await stub.Generate(REQUEST, metadata=CALLER, timeout=10)  # (a caller's context is not passed on)
            await coordinator.service.finish_releases(5)
            return worker

    worker = asyncio.run(main())
    assert worker.metadata["Verify"] and not [m for m in worker.metadata.values() if TRACEPARENT in m]


def test_a_failed_request_s_span_says_why_and_a_request_with_no_caller_trace_starts_one(tmp_path):
    async def scenario(coordinator, worker, stub):
        worker.refuse_verify = "sequence r-1 is not held here"
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.Generate(REQUEST, timeout=10)
        return failed.value.code()

    code, _, spans = run(tmp_path, scenario)
    (span,) = spans
    assert code != grpc.StatusCode.OK and span.parent is None
    assert span.status.status_code == StatusCode.ERROR and span.attributes["tandem.outcome"] == "error"
    assert span.status.description


def test_a_request_refused_before_it_runs_still_ends_its_span_as_an_error(tmp_path):
    async def scenario(coordinator, worker, stub):
        pool = coordinator.service.targets
        pool.clients, kept = [], pool.clients  # every target replica gone
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(REQUEST, metadata=CALLER, timeout=10)
        finally:
            pool.clients = kept
        return refused.value.code()

    code, _, spans = run(tmp_path, scenario)
    (span,) = spans
    assert code == grpc.StatusCode.UNAVAILABLE and f"{span.context.trace_id:032x}" == CALLER_TRACE
    assert span.attributes["tandem.outcome"] == "refused" and span.status.status_code == StatusCode.ERROR
    assert "no target workers available" in span.status.description


def test_refusals_for_room_are_events_of_the_span_and_the_request_still_ends_well(tmp_path):
    async def scenario(coordinator, worker, stub):
        worker.full_prefills = 1  # the target's pool is full when the request arrives: it waits for room
        worker.full_verifies = 1  # and again at its first Verify: it gives its KV back (preempted)
        return await stub.Generate(REQUEST, metadata=CALLER, timeout=20)

    reply, worker, spans = run(tmp_path, scenario)
    (span,) = spans
    assert list(reply.token_ids) == [TOKEN] * 3 and span.attributes["tandem.outcome"] == "ok"
    refusals = [e for e in span.events if e.name in ("refused_for_room", "preempted")]
    assert [e.name for e in refusals] == ["refused_for_room", "preempted"]
    assert all(e.attributes["tandem.refused_after_s"] >= 0 for e in refusals)
    assert span.attributes["tandem.room_waits"] == 1 and span.attributes["tandem.preemptions"] == 1
    assert worker.calls["Prefill"] == 3  # refused, admitted, and the rebuild after the preemption
