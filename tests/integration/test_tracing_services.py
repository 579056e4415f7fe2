"""A traced request through real processes: the coordinator's span joins the caller's trace, and the draft and target
workers' spans of its calls hang under it, all received by a real OTLP/gRPC receiver (tests/otlp_collector.py).

A coordinator with --otlp-traces-endpoint over the shared cluster's workers, whose own tracing points at the same
receiver (tests/integration/conftest.py); the shared coordinator, untraced, sends no trace context, so the other
tests' calls make no spans.
"""

from __future__ import annotations

import secrets
import time

import grpc
import openai
import pytest

from tandem.client import build_request
from tandem.v1 import generation_pb2_grpc
from tests.integration.conftest import MAX_NEW_TOKENS, PROMPTS

pytestmark = pytest.mark.slow

SERVER, ERROR = 2, 2  # opentelemetry.proto.trace.v1: Span.SpanKind SPAN_KIND_SERVER, Status STATUS_CODE_ERROR
EXPORT_PERIOD_S = 5.0  # how often a process sends its finished spans: the SDK's default OTEL_BSP_SCHEDULE_DELAY


@pytest.fixture(scope="module")
def traced_coordinator(shared_cluster, otlp_collector):
    from tests.integration.conftest import extra_coordinator

    with extra_coordinator(shared_cluster, ("--host", "127.0.0.1", "--http-port", "0",
                                            "--otlp-traces-endpoint", otlp_collector.endpoint)) as coordinator:
        yield coordinator


def _caller() -> tuple[str, str, str]:
    """A caller's own trace: (trace id, its span id, the traceparent that names them)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _whole(trace_id: str, request_span: str, rounds: int):
    """The request span's calls all arrived: a target Prefill, a Verify per round and a draft Propose."""
    def found(spans) -> bool:
        under = [(s.service, s.name) for s in spans if s.trace_id == trace_id and s.parent_span_id == request_span]
        return ({("tandem-target", "TargetWorker/Prefill"), ("tandem-draft", "DraftWorker/Propose")} <= set(under)
                and under.count(("tandem-target", "TargetWorker/Verify")) >= rounds)
    return found


def test_a_grpc_request_s_span_joins_the_caller_s_trace_with_its_worker_calls_under_it(traced_coordinator,
                                                                                       otlp_collector):
    trace_id, caller_span, traceparent = _caller()
    request = build_request(PROMPTS[1], max_new_tokens=MAX_NEW_TOKENS, method="draft", request_id="traced-grpc")
    with grpc.insecure_channel(traced_coordinator.address) as channel:
        reply = generation_pb2_grpc.GenerationStub(channel).Generate(
            request, timeout=120, metadata=(("traceparent", traceparent),))
    # the coordinator ends its span as the reply goes; the workers send theirs in their next batch (seconds)
    first = [s for s in otlp_collector.wait_for(lambda spans: any(
        s.trace_id == trace_id and s.name == "llm_request" for s in spans)) if s.trace_id == trace_id]
    (request_span,) = [s for s in first if s.name == "llm_request"]
    spans = [s for s in otlp_collector.wait_for(_whole(trace_id, request_span.span_id, reply.stats.rounds))
             if s.trace_id == trace_id]

    assert request_span.service == "tandem-coordinator" and request_span.kind == SERVER
    assert request_span.parent_span_id == caller_span  # under the caller's own span
    attributes = request_span.attributes
    assert attributes["gen_ai.request.id"] == "traced-grpc"
    assert attributes["gen_ai.usage.output_tokens"] == reply.stats.generated_tokens == len(reply.token_ids)
    assert attributes["gen_ai.usage.input_tokens"] == reply.stats.prompt_tokens
    assert attributes["tandem.rounds"] == reply.stats.rounds > 0
    assert attributes["tandem.accepted"] == reply.stats.accepted > 0  # (the draft is the target's own model)
    assert attributes["tandem.outcome"] == "ok" and attributes["gen_ai.response.finish_reasons"] == [
        reply.finish_reason]
    assert attributes["tandem.target_worker"] == reply.stats.target_worker
    assert "first_token" in request_span.events
    assert not any(isinstance(v, str) and "fibonacci" in v for v in attributes.values())  # no prompt, no text

    calls = [s for s in spans if s.parent_span_id == request_span.span_id]
    verifies = [s for s in calls if s.name == "TargetWorker/Verify"]
    proposes = [s for s in calls if s.name == "DraftWorker/Propose"]
    assert len(verifies) == reply.stats.rounds  # one Verify call per round, each traced
    assert proposes  # (how many: as many rounds as the cost model let the draft draft in, which load moves)
    for call in calls:
        assert call.kind == SERVER and call.status_code != ERROR
        assert call.attributes["tandem.seq_id"].startswith("traced-grpc-")
        assert call.attributes["tandem.batch.steps"] >= 1 and call.attributes["tandem.batch.queued_s"] >= 0
        assert call.attributes["tandem.batch.calls"] >= 1
    assert {call.attributes["tandem.role"] for call in calls} == {"target", "draft"}


def test_an_http_request_s_span_joins_the_traceparent_header(traced_coordinator, otlp_collector):
    trace_id, caller_span, traceparent = _caller()
    with openai.OpenAI(base_url=traced_coordinator.http_url, api_key="unused", max_retries=0, timeout=120) as client:
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=12, temperature=0, n=2, extra_headers={"traceparent": traceparent})
    spans = otlp_collector.wait_for(lambda spans: sum(
        s.trace_id == trace_id and s.name == "llm_request" for s in spans) == 2)
    requests = [s for s in spans if s.trace_id == trace_id and s.name == "llm_request"]
    assert all(s.parent_span_id == caller_span for s in requests)  # each choice is a request of its own
    assert sum(s.attributes["gen_ai.usage.output_tokens"] for s in requests) == reply.usage.completion_tokens
    assert {s.attributes["gen_ai.request.temperature"] for s in requests} == {0.0}


def test_an_untraced_coordinator_s_calls_make_no_worker_spans(shared_client, otlp_collector):
    """The shared coordinator has no tracing: it sends no trace context, and the workers, tracing on, make no span
    of its calls."""
    for prompt in PROMPTS:  # (over both replicas of each role, as placement spreads them)
        reply = shared_client.generate(build_request(prompt, chat=True, max_new_tokens=8, method="draft",
                                                     request_id="untraced-request"))
        assert reply.stats.rounds > 0  # the workers were called: a Prefill, and a Verify per round
    time.sleep(EXPORT_PERIOD_S + 1)  # a span made of them would have been sent by now
    with otlp_collector.lock:
        spans = list(otlp_collector.spans)
    assert not [s for s in spans if str(s.attributes.get("tandem.seq_id", "")).startswith("untraced-")]
