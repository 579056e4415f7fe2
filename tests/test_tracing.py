"""Request spans and their propagation (tandem.tracing), worker call spans (tandem.rpc.traced_calls), and what the
batcher records of a traced call (tandem.rpc.call_timing): through OpenTelemetry's own SDK and in-memory exporter."""

from __future__ import annotations

import asyncio
import builtins
import logging
import threading

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tandem.config import ServerOptions, check_tracing
from tandem.errors import InvalidRequestError, UnknownSequenceError
from tandem.rpc.batcher import Batcher
from tandem.rpc.call_timing import CURRENT_CALL, CallTiming
from tandem.rpc.server import ManagedServer
from tandem.tracing import EXPORTER_LOGGER, REQUEST_SPAN, TRACEPARENT, ExportErrorsPerInterval, Tracing, carrier
from tandem.v1 import target_pb2, target_pb2_grpc

# A caller's trace context, as W3C Trace Context writes it: version, trace id, parent span id, flags (sampled).
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
CALLER = {TRACEPARENT: f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}


@pytest.fixture
def exported() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing.with_provider(provider), exporter


@pytest.mark.parametrize("endpoint", ["http://otel-collector:4317", "https://collector.example:4317",
                                      "grpc://127.0.0.1:4317", "http://[::1]:4317/"])
def test_a_collector_url_with_a_scheme_and_a_port_is_taken(endpoint):
    assert ServerOptions(otlp_traces_endpoint=endpoint).otlp_traces_endpoint == endpoint


@pytest.mark.parametrize("endpoint, says", [
    ("otel-collector:4317", "http://HOST:PORT"),  # no scheme: plaintext or TLS is not guessed
    ("ftp://collector:4317", "http://HOST:PORT"),
    ("http://collector", "needs a port"),
    ("http://collector:4318/v1/traces", "no path"),  # OTLP/HTTP's path: this exporter speaks gRPC
    ("http://collector:99999", "needs a port"),
])
def test_a_malformed_collector_url_is_refused_naming_the_flag(endpoint, says):
    with pytest.raises(InvalidRequestError, match="--otlp-traces-endpoint") as refused:
        ServerOptions(otlp_traces_endpoint=endpoint)
    assert says in str(refused.value) and repr(endpoint) in str(refused.value)


def test_tracing_without_opentelemetry_installed_is_refused_with_what_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_opentelemetry(name, *args, **kwargs):
        if name.startswith("opentelemetry"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(InvalidRequestError, match=r"tandem\[tracing\]"):
        check_tracing("http://127.0.0.1:4317")
    monkeypatch.setattr(builtins, "__import__", no_opentelemetry)
    with pytest.raises(InvalidRequestError, match=r"not installed .*tandem\[tracing\]"):
        Tracing.open("http://127.0.0.1:4317", "tandem-coordinator")


def test_off_by_default_every_call_does_nothing():
    assert not ServerOptions().otlp_traces_endpoint
    tracing = Tracing.open(None, "tandem-coordinator")
    assert not tracing.enabled
    trace = tracing.request(CALLER, 0.0, {"gen_ai.request.id": "r"})
    assert not trace.recording and trace.metadata == ()
    trace.event("first_token")
    trace.finish({"tandem.outcome": "ok"})
    with tracing.call("TargetWorker/Verify", CALLER, {}) as span:
        assert span is None
    tracing.shutdown()


def test_the_trace_headers_are_found_in_metadata_and_headers_in_any_case():
    pairs = (("authorization", "Bearer x"), ("TraceParent", CALLER[TRACEPARENT]), ("tracestate", "k=v"),
             ("grpc-binary-bin", b"\x00"))
    assert carrier(pairs) == {"traceparent": CALLER[TRACEPARENT], "tracestate": "k=v"}
    assert carrier({"Traceparent": CALLER[TRACEPARENT], "X-Request-Id": "a"}) == {"traceparent": CALLER[TRACEPARENT]}
    assert carrier(None) == {}


def test_a_request_span_joins_the_callers_trace_and_names_itself_to_the_workers(exported):
    tracing, exporter = exported
    import time

    started = time.perf_counter() - 0.25  # (the request arrived a quarter second ago)
    trace = tracing.request(CALLER, started, {"gen_ai.request.id": "req-1", "gen_ai.request.seed": None,
                                              "tandem.draft_worker": ""})
    assert trace.recording
    sent = dict(trace.metadata)
    version, trace_id, span_id, flags = sent[TRACEPARENT].split("-")
    assert (version, trace_id, flags) == ("00", CALLER_TRACE, "01") and span_id != CALLER_SPAN
    trace.event("first_token")
    trace.finish({"gen_ai.usage.output_tokens": 7, "gen_ai.response.finish_reasons": ["stop"]})
    trace.finish({"gen_ai.usage.output_tokens": 8})  # (a second finish is nothing: the span ended once)
    (span,) = exporter.get_finished_spans()
    assert span.name == REQUEST_SPAN and span.kind == SpanKind.SERVER
    assert f"{span.context.trace_id:032x}" == CALLER_TRACE and f"{span.parent.span_id:016x}" == CALLER_SPAN
    assert f"{span.context.span_id:016x}" == span_id  # the workers' spans hang under this one
    assert span.attributes["gen_ai.request.id"] == "req-1" and span.attributes["gen_ai.usage.output_tokens"] == 7
    assert tuple(span.attributes["gen_ai.response.finish_reasons"]) == ("stop",)
    assert "gen_ai.request.seed" not in span.attributes and "tandem.draft_worker" not in span.attributes
    assert [e.name for e in span.events] == ["first_token"]
    assert 0.24 <= (span.end_time - span.start_time) / 1e9 < 60  # from the request's arrival, not the span's making
    assert span.status.status_code == StatusCode.UNSET


def test_a_request_without_a_caller_trace_starts_one_and_a_failure_is_its_status(exported):
    tracing, exporter = exported
    trace = tracing.request({}, 0.0, {})
    trace.finish({"tandem.outcome": "error"}, error="WorkerUnavailableError: no target worker")
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and span.status.status_code == StatusCode.ERROR
    assert "no target worker" in span.status.description


def test_the_batcher_records_a_traced_calls_steps_and_nothing_for_an_untraced_one():
    gate = threading.Event()

    def run_batch(items):
        gate.wait(5)
        return items

    async def scenario():
        batcher = Batcher(run_batch, cost=lambda i: 3, token_budget=100)
        batcher.start()
        first = asyncio.create_task(batcher.submit(0))  # untraced: holds the model while the others queue
        await asyncio.sleep(0.05)
        timing = CallTiming()

        async def traced():
            CURRENT_CALL.set(timing)  # (in this task's own context, as the interceptor sets it)
            return await batcher.submit(1)

        second = asyncio.create_task(traced())
        third = asyncio.create_task(batcher.submit(2))
        await asyncio.sleep(0.1)
        gate.set()
        results = await asyncio.gather(first, second, third)
        await batcher.stop()
        return results, timing

    results, timing = asyncio.run(scenario())
    assert results == [0, 1, 2]
    assert timing.steps == 1 and timing.step_calls == 2 and timing.step_tokens == 6  # it shared its step with 2
    assert timing.first_step_at is not None and timing.first_step_at - timing.submitted_at >= 0.1  # queued behind 0
    attributes = timing.attributes()
    assert attributes["tandem.batch.queued_s"] >= 0.1 and attributes["tandem.batch.compute_s"] >= 0
    assert CURRENT_CALL.get() is None  # (the tasks' contexts were copies)


class _Target(target_pb2_grpc.TargetWorkerServicer):
    """A target servicer whose Verify goes through a real batcher, as a worker's does."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher

    async def Verify(self, request, context):
        if request.seq_id == "unknown":
            raise UnknownSequenceError("no such sequence")
        await self.batcher.submit(request.seq_id)
        return target_pb2.VerifyResponse(num_accepted=0, next_token=5)


def test_a_worker_call_carrying_a_traceparent_gets_a_span_under_it_and_others_none(exported):
    """Through a real gRPC server as a worker builds it: the interceptor inside the error mapping, the batcher's
    record of the call."""
    tracing, exporter = exported

    async def scenario():
        server = ManagedServer("target", ServerOptions(host="127.0.0.1", port=0), traced_calls=True, tracing=tracing)
        batcher = Batcher(lambda items: items, cost=lambda i: 4, token_budget=100)
        batcher.start()
        server.add_service(target_pb2_grpc.add_TargetWorkerServicer_to_server, _Target(batcher),
                           "tandem.v1.TargetWorker")
        port = await server.start()
        await server.set_serving()
        request_trace = tracing.request(CALLER, 0.0, {})
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = target_pb2_grpc.TargetWorkerStub(channel)
            await stub.Verify(target_pb2.VerifyRequest(seq_id="s-1", committed_len=12, draft_tokens=[1, 2, 3]),
                              metadata=request_trace.metadata)
            await stub.Verify(target_pb2.VerifyRequest(seq_id="s-2"))  # no traceparent: no span
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Verify(target_pb2.VerifyRequest(seq_id="unknown"), metadata=request_trace.metadata)
        await server.server.stop(None)
        await batcher.stop()
        request_trace.finish({})
        return refused.value.code()

    assert asyncio.run(scenario()) == grpc.StatusCode.NOT_FOUND  # (the error mapping still answers for the handler)
    spans = exporter.get_finished_spans()
    calls = [s for s in spans if s.name == "TargetWorker/Verify"]
    (request,) = [s for s in spans if s.name == REQUEST_SPAN]
    assert [s.attributes["tandem.seq_id"] for s in calls] == ["s-1", "unknown"]
    ok, failed = calls
    assert ok.kind == SpanKind.SERVER and ok.parent.span_id == request.context.span_id
    assert ok.context.trace_id == request.context.trace_id == int(CALLER_TRACE, 16)
    assert ok.attributes["rpc.method"] == "Verify" and ok.attributes["rpc.service"] == "tandem.v1.TargetWorker"
    assert ok.attributes["tandem.role"] == "target" and ok.attributes["tandem.committed_len"] == 12
    assert ok.attributes["tandem.draft_tokens"] == 3
    assert ok.attributes["tandem.batch.steps"] == 1 and ok.attributes["tandem.batch.tokens"] == 4
    assert ok.status.status_code == StatusCode.UNSET
    assert failed.status.status_code == StatusCode.ERROR and failed.attributes["tandem.batch.steps"] == 0
    assert any(e.name == "exception" for e in failed.events)


def test_a_worker_server_adds_its_call_spans_only_with_tracing_on(exported):
    tracing, _ = exported

    async def built() -> list[bool]:  # (a grpc.aio server is made on a running loop)
        options = ServerOptions(host="127.0.0.1", port=0)
        return [_traced(ManagedServer("target", options, traced_calls=True)),
                _traced(ManagedServer("coordinator", options, tracing=tracing)),
                _traced(ManagedServer("target", options, traced_calls=True, tracing=tracing))]

    assert asyncio.run(built()) == [False, False, True]


def _traced(server: ManagedServer) -> bool:
    from tandem.rpc.traced_calls import TracedCalls

    return any(isinstance(i, TracedCalls) for i in server.interceptors)


def test_stopping_never_waits_on_a_collector_that_does_not_answer(caplog):
    """A server stops within its own grace: the exporter's retries against a collector that hangs are left behind
    (before, a down collector held the exit for the exporter's timeout)."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    release = threading.Event()

    class HangingCollector(SpanExporter):
        def export(self, spans):
            release.wait()  # never answers while the test runs
            return SpanExportResult.SUCCESS

    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(HangingCollector()))
    tracing = Tracing.with_provider(provider)
    tracing.request({}, 0.0, {}).finish({})
    try:
        tracing.shutdown(0.2)  # returns: pytest-timeout would fail the test if it hung here
        assert not tracing.enabled
        assert "spans not yet sent are dropped" in caplog.text
        tracing.shutdown(0.2)  # (a second stop is nothing)
    finally:
        release.set()


def test_a_down_collector_is_reported_once_then_once_per_interval_with_a_count():
    now = [100.0]
    errors = ExportErrorsPerInterval(every_s=60.0, clock=lambda: now[0])
    logger = logging.getLogger("tests.tracing.exporter")
    logger.propagate = False
    passed: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            passed.append(record.getMessage())

    logger.addHandler(Keep())
    logger.addFilter(errors)
    for second in range(0, 125, 5):  # a batch fails every 5 s: a retry warning, then the failure
        now[0] = 100.0 + second
        logger.warning("Transient error %s, retrying", "UNAVAILABLE")
        logger.error("Failed to export traces")
    held = " (11 more like it held back in the last 60 s)"
    assert passed == ["Transient error UNAVAILABLE, retrying", "Failed to export traces"] + [
        "Transient error UNAVAILABLE, retrying" + held, "Failed to export traces" + held] * 2


def test_the_exporters_log_filter_lives_as_long_as_the_tracing_that_set_it():
    def ours():
        return [f for f in logging.getLogger(EXPORTER_LOGGER).filters if isinstance(f, ExportErrorsPerInterval)]

    tracing = Tracing.open("http://127.0.0.1:9", "tandem-test")  # (nothing is sent: no span is made)
    assert len(ours()) == 1
    tracing.shutdown(1.0)
    assert ours() == []
