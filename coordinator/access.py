"""Who may call the public API, and how much at once: the coordinator's access interceptor.

Only ``tandem.v1.Generation`` is guarded; ``grpc.health.v1`` and reflection
stay open, so orchestrators' probes need no token. With bearer auth on, a call
without ``authorization: Bearer <token>`` (or with an unknown token) is refused
UNAUTHENTICATED before its message is even parsed; the refusal says what was
missing and never echoes what was sent.

With ``max_concurrent_per_client`` > 0, a client holds at most that many
calls of the service at once (Generate, GenerateStream and Info alike: Info
answers from the last periodic poll of the workers, yet a client must not be
able to call without a bound where the others are limited); one more is
refused RESOURCE_EXHAUSTED. The client is the bearer token's identity when auth is on
(every holder of one token counts as one client), else the peer's host as
gRPC reports it (``context.peer()``: every connection from one address counts
as one client, so clients behind one NAT or proxy share a budget).

The HTTP API (coordinator/http) asks the same object: ``identify`` for its
``Authorization`` header and ``hold`` for its slots, so a client's budget is one
across both APIs.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from tandem.errors import ClientLimitError, UnauthenticatedError
from tandem.rpc.auth import METADATA_KEY, BearerAuth
from tandem.rpc.handlers import Behavior, rewrap
from tandem.rpc.refusal import refusing

SERVICE = "tandem.v1.Generation"


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string: ``ipv4:10.0.0.7:5123`` -> ``10.0.0.7``, ``ipv6:[::1]:5123`` -> ``::1``."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]") or rest
    return peer  # unix sockets and anything else: the whole string


class AccessControl(grpc.aio.ServerInterceptor):
    def __init__(self, auth: BearerAuth | None, max_concurrent_per_client: int = 0, service: str = SERVICE) -> None:
        self.auth = auth
        self.max_concurrent = max_concurrent_per_client
        self.prefix = f"/{service}/"
        self.in_flight: dict[str, int] = {}  # client -> calls running now (only clients with one or more)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        identity = None
        if self.auth is not None:
            metadata = {k.lower(): v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
            identity = self.identify(metadata.get(METADATA_KEY))
            if identity is None:
                return _refusing(handler, _refusal(metadata))
        if self.max_concurrent <= 0:
            return handler
        return rewrap(handler, lambda behavior: self._guard_unary(behavior, identity),
                      lambda behavior: self._guard_stream(behavior, identity))

    def identify(self, authorization: str | None) -> str | None:
        """The client identity (``token-N``) of an ``authorization`` value, None if it presents no known token
        (or auth is off: call only with ``auth`` set)."""
        assert self.auth is not None
        return self.auth.identify({METADATA_KEY: authorization or ""})

    @contextlib.contextmanager
    def hold(self, client: str, count: int = 1) -> Any:
        """``count`` of ``client``'s concurrent requests while in the block (no limit: nothing held);
        ``ClientLimitError`` if they do not fit its budget."""
        if self.max_concurrent <= 0:
            yield
            return
        held = self.in_flight.get(client, 0)
        if held + count > self.max_concurrent:
            raise ClientLimitError(f"too many concurrent requests from this client: at most {self.max_concurrent} "
                                   "at once (--max-concurrent-per-client); retry when one has finished")
        self.in_flight[client] = held + count
        try:
            yield
        finally:
            left = self.in_flight[client] - count
            if left:
                self.in_flight[client] = left
            else:
                del self.in_flight[client]

    def _slot(self, identity: str | None, context: grpc.aio.ServicerContext) -> Any:
        return self.hold(identity or peer_host(context.peer() or ""))

    def _guard_unary(self, behavior: Behavior, identity: str | None) -> Behavior:
        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with self._slot(identity, context):
                return await behavior(request, context)

        return guarded

    def _guard_stream(self, behavior: Behavior, identity: str | None) -> Behavior:
        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with self._slot(identity, context):
                async for item in behavior(request, context):
                    yield item

        return guarded


def _refusal(metadata: dict[str, str]) -> str:
    if METADATA_KEY not in metadata:
        return (f"{SERVICE} needs a bearer token: send metadata 'authorization: Bearer <token>' "
                "(tandem generate: --token-file or $TANDEM_AUTH_TOKEN)")
    return "the bearer token in 'authorization' is not valid here"


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind that refuses UNAUTHENTICATED without parsing the request."""
    async def refuse(context: grpc.aio.ServicerContext) -> None:
        raise UnauthenticatedError(message)

    return refusing(handler, refuse)
