"""A real OTLP/gRPC trace receiver for tests: what an OpenTelemetry Collector's ``otlp`` receiver speaks.

It serves ``opentelemetry.proto.collector.trace.v1.TraceService/Export`` on
127.0.0.1 and keeps every span it is sent, flattened with its process's
``service.name``, so that a test reads what Tandem's processes exported over
the wire exactly as a collector would receive it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the exporting process's resource attribute service.name
    name: str
    trace_id: str  # hex, as W3C traceparent writes it
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind (2: SERVER)
    status_code: int  # 0 unset, 1 ok, 2 error
    attributes: dict[str, Any]
    events: tuple[str, ...]


def _value(any_value: common_pb2.AnyValue) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _attributes(pairs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: OtlpCollector) -> None:
        self.collector = collector

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context):
        received = []
        for resource_spans in request.resource_spans:
            service = str(_attributes(resource_spans.resource.attributes).get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service, span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                        span.kind, span.status.code, _attributes(span.attributes),
                        tuple(event.name for event in span.events)))
        with self.collector.lock:
            self.collector.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpCollector:
    """``with OtlpCollector() as collector:`` ... ``collector.endpoint`` (http://127.0.0.1:PORT), ``wait_for``."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Receiver(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpCollector:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(None)

    def wait_for(self, found: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 60.0) -> list[ReceivedSpan]:
        """Every span received, once ``found(spans)`` holds (processes export in batches, every few seconds);
        raises ``AssertionError`` with what did arrive if it never does within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                spans = list(self.spans)
            if found(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(f"the spans looked for did not arrive within {timeout_s:.0f} s; got {names}")
            time.sleep(0.2)
