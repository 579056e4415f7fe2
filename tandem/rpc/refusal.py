"""A method handler that refuses every call without parsing its request: what a gate returns instead of the servicer's.

The access control (no valid token) and the server's start-up gate (not warmed
up yet) both answer before the servicer runs; the request is never parsed, so
a stranger's garbage costs nothing and a malformed message gets the same refusal.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from tandem.rpc.handlers import rewrap

# Ends the call: raises a domain error (mapped to its status by the error mapping) or aborts with a status.
Refuse = Callable[[grpc.aio.ServicerContext], Awaitable[Any]]


def refusing(handler: grpc.RpcMethodHandler, refuse: Refuse) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind whose every call ends in ``refuse(context)``, with no deserializer."""
    async def refuse_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse(context)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await refuse(context)
        yield  # never reached: an async generator, like the handler it stands in for

    return rewrap(handler, lambda _: refuse_unary, lambda _: refuse_stream, request_deserializer=None)
