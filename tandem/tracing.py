"""OpenTelemetry traces of a request across the coordinator and the workers it calls.

Off unless a server is given ``--otlp-traces-endpoint``; the packages are an
extra (``pip install 'tandem[tracing]'``) and are imported only then. With it:

- The coordinator opens one span per request, ``llm_request`` (SERVER), as
  vLLM names it, under the caller's own trace when the call carries W3C
  ``traceparent``/``tracestate`` (HTTP headers or gRPC metadata). It starts when
  the request arrived and ends when its answer does; its attributes are
  OpenTelemetry's GenAI names (and vLLM's latency names) beside Tandem's own
  speculation figures (``tandem.*``): what a reply's stats say, never the
  prompt or the text.
- Every worker call the request makes (Prefill, Verify, Propose, Release)
  carries that span's ``traceparent`` in its metadata, and a worker with
  tracing on answers it inside a span of its own (``TargetWorker/Verify``,
  SERVER) that says how long the call waited for its batch step, how many
  steps it took, the step's calls and tokens and its compute time
  (``tandem.rpc.call_timing``). A trace then shows, request by request, where
  the time went: in the queue, in the draft, or in the target's forward.

Each process exports its own spans over OTLP/gRPC in batches from a
background thread (the SDK's ``BatchSpanProcessor``): a request never waits
for the collector, and a collector that is down costs dropped spans, not
requests. Nothing here is process-global: a ``Tracing`` holds its own
provider, and the OpenTelemetry API's global provider is left alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from tandem.errors import InvalidRequestError

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"  # W3C Trace Context: the caller's trace and span
TRACESTATE = "tracestate"
TRACE_HEADERS = (TRACEPARENT, TRACESTATE)
INSTALL_HINT = "pip install 'tandem[tracing]' (opentelemetry-sdk and opentelemetry-exporter-otlp-proto-grpc)"
SHUTDOWN_TIMEOUT_S = 5.0  # at exit: the spans still queued get this long to reach the collector
REQUEST_SPAN = "llm_request"  # vLLM's name for the same span, so that a dashboard built for it finds ours
EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"  # where the OTLP exporter logs its failures
EXPORT_ERRORS_EVERY_S = 60.0  # with the collector down: its first failure logged, then one a minute


def check_endpoint(endpoint: str | None) -> None:
    """``--otlp-traces-endpoint``: an OTLP/gRPC collector's ``http://`` or ``grpc://`` (plaintext) or ``https://``
    (TLS) URL with a host and a port; None: tracing off."""
    if endpoint is None:
        return
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https", "grpc") or not parts.hostname:
        raise InvalidRequestError(
            f"--otlp-traces-endpoint must be an OTLP/gRPC collector's URL, http://HOST:PORT or grpc://HOST:PORT "
            f"(plaintext) or https://HOST:PORT (TLS), e.g. http://otel-collector:4317; got {endpoint!r}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None or parts.path not in ("", "/"):
        raise InvalidRequestError(
            f"--otlp-traces-endpoint needs a port and no path (OTLP/gRPC listens on 4317 by default), e.g. "
            f"http://otel-collector:4317; got {endpoint!r}")


def carrier(pairs: Iterable[tuple[str, Any]] | Mapping[str, Any] | None) -> dict[str, str]:
    """The trace headers among a call's metadata or an HTTP request's headers (names in any case)."""
    items = pairs.items() if isinstance(pairs, Mapping) else (pairs or ())
    found = {}
    for key, value in items:
        name = str(key).lower()
        if name in TRACE_HEADERS and isinstance(value, str):
            found[name] = value
    return found


class ExportErrorsPerInterval(logging.Filter):
    """The OTLP exporter logs two lines for every batch it cannot send (a retry warning, then the failure): with
    the collector down, a pair every few seconds for as long as it is down. This lets the first of each level
    through, then one per level per ``every_s``, saying how many of that level it held back in between."""

    def __init__(self, every_s: float = EXPORT_ERRORS_EVERY_S, clock=time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self._clock = clock
        self._next_at: dict[int, float] = {}  # per level: when its next message may pass
        self._held: dict[int, int] = {}  # per level: messages held back since the last one passed

    def filter(self, record: logging.LogRecord) -> bool:
        now, level = self._clock(), record.levelno
        if now < self._next_at.get(level, now):
            self._held[level] = self._held.get(level, 0) + 1
            return False
        held = self._held.pop(level, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like it held back in the last {self.every_s:g} s)"
        self._next_at[level] = now + self.every_s
        return True


class RequestTrace:
    """One request's span on the coordinator, or none (``RequestTrace()``: every method does nothing)."""

    def __init__(self, span: Any = None, propagator: Any = None, trace_api: Any = None) -> None:
        self._span = span
        self.metadata: tuple[tuple[str, str], ...] = ()  # sent with every worker call of the request
        if span is not None:
            headers: dict[str, str] = {}
            propagator.inject(headers, context=trace_api.set_span_in_context(span))
            self.metadata = tuple(sorted(headers.items()))

    @property
    def recording(self) -> bool:
        return self._span is not None

    def event(self, name: str, **attributes: Any) -> None:
        if self._span is not None:
            self._span.add_event(name, attributes=_clean(attributes))

    def finish(self, attributes: Mapping[str, Any], error: str | None = None) -> None:
        """End the span with what the request came to; ``error``: why it failed (the span's status says so)."""
        if self._span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        self._span.set_attributes(_clean(attributes))
        if error is not None:
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()
        self._span = None


class Tracing:
    """A process's spans, exported over OTLP/gRPC (``Tracing.open``), or none (``Tracing()``)."""

    def __init__(self, provider: Any = None, tracer: Any = None,
                 export_errors: ExportErrorsPerInterval | None = None) -> None:
        self._provider = provider
        self._tracer = tracer
        self._export_errors = export_errors  # on the exporter's logger while this process traces; removed at shutdown
        self._propagator: Any = None
        self._trace_api: Any = None
        if tracer is not None:
            from opentelemetry import trace
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            self._propagator = TraceContextTextMapPropagator()
            self._trace_api = trace

    @classmethod
    def open(cls, endpoint: str | None, service: str) -> Tracing:
        """Spans of the service named ``service`` (``tandem-coordinator``...; ``$OTEL_SERVICE_NAME`` and
        ``$OTEL_RESOURCE_ATTRIBUTES`` take precedence, as the SDK reads them) sent to ``endpoint``; None: off.
        Raises ``InvalidRequestError`` when the endpoint is malformed or the packages are not installed."""
        if endpoint is None:
            return cls()
        check_endpoint(endpoint)
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise InvalidRequestError(f"--otlp-traces-endpoint needs OpenTelemetry, which is not installed "
                                      f"({exc}): {INSTALL_HINT}") from None
        from_env = OTELResourceDetector().detect()
        named = {} if from_env.attributes.get(SERVICE_NAME) else {SERVICE_NAME: service}
        resource = Resource.create({**named, "service.version": _version()})
        parts = urlsplit(endpoint)
        if parts.scheme == "grpc":  # (the exporter knows http:// and https://; grpc:// is what vLLM's docs show)
            exporter = OTLPSpanExporter(endpoint=f"{parts.hostname}:{parts.port}", insecure=True)
        else:
            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=parts.scheme == "http")
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # (our own shutdown bounds the wait)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        export_errors = ExportErrorsPerInterval()
        logging.getLogger(EXPORTER_LOGGER).addFilter(export_errors)
        log.info("tracing: spans of %s go to %s over OTLP/gRPC", resource.attributes.get(SERVICE_NAME), endpoint)
        return cls(provider, provider.get_tracer("tandem", _version()), export_errors)

    @classmethod
    def with_provider(cls, provider: Any) -> Tracing:
        """Spans through a provider the caller made (tests: the SDK's in-memory exporter)."""
        return cls(provider, provider.get_tracer("tandem", _version()))

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def request(self, headers: Mapping[str, str], started_at: float, attributes: Mapping[str, Any]) -> RequestTrace:
        """A request's span, under the trace its caller's ``headers`` (``carrier``) name, started at
        ``started_at`` (``time.perf_counter()`` when the request arrived)."""
        if self._tracer is None:
            return RequestTrace()
        from opentelemetry.trace import SpanKind

        span = self._tracer.start_span(REQUEST_SPAN, context=self._propagator.extract(dict(headers)),
                                       kind=SpanKind.SERVER, attributes=_clean(attributes),
                                       start_time=_unix_ns(started_at))
        return RequestTrace(span, self._propagator, self._trace_api)

    @contextmanager
    def call(self, name: str, headers: Mapping[str, str], attributes: Mapping[str, Any]):
        """A worker call's span (SERVER) under the request span its metadata names; without ``traceparent`` there
        (an Info poll, a caller without tracing) no span: yields None. An exception escaping marks the span
        failed and goes on."""
        if self._tracer is None or TRACEPARENT not in headers:
            yield None
            return
        from opentelemetry.trace import SpanKind

        with self._tracer.start_as_current_span(name, context=self._propagator.extract(dict(headers)),
                                                kind=SpanKind.SERVER, attributes=_clean(attributes)) as span:
            yield span

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Send the spans still queued and stop the exporter, waiting at most ``timeout_s``: with the collector
        down, the exporter's own retries would hold a stopping server for ten seconds more (measured: 7.5 s for one
        span). Whatever is left then is dropped with the process (a daemon thread)."""
        provider, self._provider, self._tracer = self._provider, None, None
        if provider is None:
            return

        def flush_and_stop() -> None:
            provider.force_flush(int(timeout_s * 1000))
            provider.shutdown()

        stopping = threading.Thread(target=flush_and_stop, name="tracing-shutdown", daemon=True)
        stopping.start()
        stopping.join(timeout_s)
        if self._export_errors is not None:
            logging.getLogger(EXPORTER_LOGGER).removeFilter(self._export_errors)
            self._export_errors = None
        if stopping.is_alive():
            log.warning("tracing: the collector took more than %g s; spans not yet sent are dropped", timeout_s)


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """OpenTelemetry takes str, bool, int, float and lists of one of them; None and empty strings are left out."""
    return {k: v for k, v in attributes.items() if v is not None and v != ""}


def _unix_ns(perf_counter_s: float) -> int:
    """A ``time.perf_counter()`` reading as Unix nanoseconds (what span times are)."""
    return time.time_ns() - int((time.perf_counter() - perf_counter_s) * 1e9)


def _version() -> str:
    from tandem import __version__

    return __version__

