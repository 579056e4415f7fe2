"""Lifecycle of every Tandem gRPC server: start, health, reflection, metrics, graceful drain.

Health says NOT_SERVING until the role's warm-up (weights loaded, one real
forward pass run; for a coordinator, a target worker found and asked for the
model's limits) has finished, so orchestrators route nothing to a worker that
would answer slowly or not at all; and until then the role's own services
answer every call UNAVAILABLE ("... is starting"), which clients retry,
rather than run before what they need is there (a coordinator would judge
requests against a context of 0). On SIGTERM (or SIGINT) the server
turns NOT_SERVING, refuses new work with UNAVAILABLE, lets calls in flight
finish for ``drain_grace_s``, then stops. With ``options.tls`` the port is
TLS (mutual TLS with a client CA); extra interceptors (the coordinator's access
control) run inside the error mapping, so the domain errors they raise become
statuses too.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from tandem.config import ServerOptions
from tandem.errors import ListenError, ShuttingDownError
from tandem.rpc import connection_age
from tandem.rpc.refusal import refusing
from tandem.rpc.status import ErrorMappingInterceptor
from tandem.rpc.traced_calls import TracedCalls
from tandem.tracing import Tracing

log = logging.getLogger(__name__)

# Verify requests carry k sparse distributions; leave ample room.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A failed worker's calls in flight are answered UNAVAILABLE by its engine at once; this is for their replies.
FAILED_STOP_GRACE_S = 1.0
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class ManagedServer:
    """A ``grpc.aio`` server with the pieces every role needs."""

    def __init__(self, role: str, options: ServerOptions, *,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 max_receive_bytes: int = MAX_MESSAGE_BYTES, traced_calls: bool = False,
                 tracing: Tracing | None = None) -> None:
        """``traced_calls``: a worker's, whose calls that carry a request's ``traceparent`` get spans of their own
        (``tandem.rpc.traced_calls``); a coordinator opens its requests' spans itself. ``tracing``: where spans go
        (default: as ``options.otlp_traces_endpoint`` says)."""
        self.role = role
        self.options = options
        self.registry = CollectorRegistry()  # one per server: no process-global metrics
        # This process's spans (off without --otlp-traces-endpoint); flushed as the server stops.
        self.tracing = tracing or Tracing.open(options.otlp_traces_endpoint, f"tandem-{role}")
        if traced_calls and self.tracing.enabled:
            interceptors = [*interceptors, TracedCalls(self.tracing, role)]
        # gRPC itself refuses a larger message with RESOURCE_EXHAUSTED before any handler runs.
        grpc_options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                        ("grpc.max_receive_message_length", max_receive_bytes),
                        # gRPC binds with SO_REUSEPORT by default: a second server on a port in use then starts,
                        # and the kernel shares connections between the two (a second `tandem up` on :50051 did).
                        ("grpc.so_reuseport", 0),
                        *connection_age.grpc_options(options.max_connection_age_s)]
        # The start-up gate innermost: a caller without a valid token hears that first.
        self.interceptors = [ErrorMappingInterceptor(), *interceptors, _StartingGate(self)]
        self.server = grpc.aio.server(interceptors=self.interceptors, options=grpc_options)
        self.health = health.aio.HealthServicer()
        self.service_names: list[str] = []
        self.serving = False  # warmed up: set_serving has run
        self.draining = False
        self.on_drain: list[Callable[[], None]] = []  # run as draining starts (a batcher answers its held calls)
        # Awaited with the drain grace before the server stops (a coordinator's requests finish, or are ended with
        # a clear error when the grace runs short: coordinator.in_flight); the server then gets what is left of it.
        self.drain_work: Callable[[float], Awaitable[object]] | None = None
        self.port = 0
        self.metrics_port: int | None = None
        self.metrics_host: str | None = None
        self.more_ports: dict[str, int] = {}  # named in the TANDEM_READY line after the others (http_port=...)

    def add_service(self, add_to_server: Callable[[object, grpc.aio.Server], None], servicer: object,
                    full_name: str) -> None:
        add_to_server(servicer, self.server)
        self.service_names.append(full_name)

    def check_accepting(self) -> None:
        """Servicers call this before taking new work."""
        if self.draining:
            raise ShuttingDownError(f"{self.role} is shutting down and takes no new work")

    async def start(self) -> int:
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.options.host}:{self.options.port}"
        tls = self.options.tls
        try:
            self.port = (self.server.add_secure_port(address, tls.credentials()) if tls
                         else self.server.add_insecure_port(address))
        except RuntimeError:  # grpc.aio: "Failed to bind to address ..."
            self.port = 0
        if self.port == 0:
            raise ListenError(f"{self.role}: cannot listen on {self.options.host}:{self.options.port} (--port): the "
                              "port is in use (another server?), or the host is not this machine's")
        await self.server.start()
        if self.options.metrics_port is not None:
            # on the API's host: a server bound to 127.0.0.1 (`tandem up`'s) keeps its metrics local too
            try:
                http_server, _ = start_http_server(self.options.metrics_port, addr=self.options.host,
                                                   registry=self.registry)
            except OSError as exc:  # in use: a clean error, as --port's, not a traceback after the model loaded
                await self.server.stop(None)
                raise ListenError(f"{self.role}: cannot serve metrics on {self.options.host}:"
                                  f"{self.options.metrics_port} (--metrics-port): {exc.strerror or exc}") from None
            self.metrics_port = http_server.server_port
            self.metrics_host = http_server.server_address[0]
        return self.port

    async def set_serving(self) -> None:
        self.serving = True
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        # One machine-readable line: `tandem up` and the tests wait for it.
        more = "".join(f" {name}={port}" for name, port in self.more_ports.items())
        print(f"TANDEM_READY role={self.role} port={self.port} metrics_port={self.metrics_port or 0}{more}",
              flush=True)

    async def fail_and_stop(self) -> None:
        """The worker cannot serve any more (a tensor-parallel rank died): NOT_SERVING, then stop at once."""
        self.draining = True
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(FAILED_STOP_GRACE_S)
        self.tracing.shutdown()

    async def drain_and_stop(self) -> None:
        if self.draining:
            return
        self.draining = True
        for hook in self.on_drain:
            hook()
        log.info("%s: draining for up to %.1fs", self.role, self.options.drain_grace_s)
        await self.health.enter_graceful_shutdown()
        grace = self.options.drain_grace_s
        if self.drain_work is not None:
            started = time.monotonic()
            await self.drain_work(grace)
            grace = max(0.0, grace - (time.monotonic() - started))
        await self.server.stop(grace)
        self.tracing.shutdown()  # (the last calls' spans, sent before the process exits)


class _StartingGate(grpc.aio.ServerInterceptor):
    """Until the server is warmed up, its role's services answer UNAVAILABLE, saying it is starting.

    Health and reflection answer from the start (probes read NOT_SERVING there).
    """

    def __init__(self, server: ManagedServer) -> None:
        self.server = server

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or self.server.serving:
            return handler
        if details.method.lstrip("/").partition("/")[0] not in self.server.service_names:
            return handler
        return refusing(handler, self._refuse)

    async def _refuse(self, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"the {self.server.role} is starting (not warmed up yet); retry shortly")


async def serve_until_signalled(server: ManagedServer, warmup: Callable[[], Awaitable[None]],
                                failed: asyncio.Event | None = None) -> bool:
    """Start, warm up, mark serving, and run until SIGTERM/SIGINT, then drain.

    Or until ``failed`` is set: then stop without draining and return False (exit non-zero).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    port = await server.start()
    log.info("%s listening on port %d (not serving until warmed up)", server.role, port)
    stopper = asyncio.create_task(stop.wait())
    failer = asyncio.create_task((failed or asyncio.Event()).wait())
    # A signal during the warm-up (a coordinator still waiting for its first worker) stops it
    # too, and so does a failure (a tensor-parallel rank lost while loading).
    warming = asyncio.create_task(warmup())
    await asyncio.wait({warming, stopper, failer}, return_when=asyncio.FIRST_COMPLETED)
    waiter = None
    if not warming.done():
        warming.cancel()
        await asyncio.gather(warming, return_exceptions=True)
    else:
        warming.result()  # a failed warm-up fails the server
        await server.set_serving()
        waiter = asyncio.create_task(server.server.wait_for_termination())
        await asyncio.wait({waiter, stopper, failer}, return_when=asyncio.FIRST_COMPLETED)
    healthy = not failer.done()
    await (server.drain_and_stop() if healthy else server.fail_and_stop())
    for task in (waiter, stopper, failer):
        if task is not None:
            task.cancel()
    # Drained and on the way out. A repeated SIGTERM (a supervisor, or `tandem up` stopping
    # what was already stopping) must not turn this clean exit into death by signal while
    # the interpreter tears down (measured: 2 of 7 runs of the drain test exited with -15).
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
    return healthy


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(stream=sys.stderr, level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
