"""One place that maps domain errors to gRPC status codes, and back.

Servers install ``ErrorMappingInterceptor`` so a servicer simply raises
``InvalidRequestError`` and the client sees INVALID_ARGUMENT with the same
message. The coordinator calls ``worker_failure`` on a worker's status: what
the worker refused was the coordinator's own call, never the client's, so it
becomes INTERNAL (or UNAVAILABLE, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED for
capacity and liveness), with a message that names no internal address. The
address and the worker's own message go to the coordinator's log.

An exception nobody mapped is INTERNAL with a fixed message and an error id;
the id is in the server's log line with the exception and its traceback. Its
text (a path, a template's source, a worker's address) never reaches the
caller. An ``InternalError`` raised on purpose keeps its own message (written
for clients), with the id added.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from tandem import errors
from tandem.rpc.handlers import rewrap

log = logging.getLogger(__name__)

KV_FULL_PREFIX = "KV cache "  # how a worker's KVCacheExhaustedError messages begin (tandem/kv_cache.py, block_pool.py)

# Most specific first: the first isinstance match wins.
STATUS_OF: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.UnknownSequenceError, grpc.StatusCode.NOT_FOUND),
    (errors.InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (errors.ClientLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.KVCacheExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.ShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (errors.WorkerUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.WorkerDeadlineError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.StaleSequenceError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ModelFileError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.InternalError, grpc.StatusCode.INTERNAL),
)

# A worker's status, as the coordinator passes it on: capacity and liveness keep their meaning;
# everything else was a fault of the coordinator's internal call (or of the worker), not the client's.
_WORKER_FAILURES: dict[grpc.StatusCode, tuple[type[errors.TandemError], str]] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: (errors.KVCacheExhaustedError,
                                         "the {role} workers are out of KV cache; retry later"),
    grpc.StatusCode.UNAVAILABLE: (errors.WorkerUnavailableError, "a {role} worker is unavailable"),
    grpc.StatusCode.CANCELLED: (errors.WorkerUnavailableError, "a {role} worker call was cancelled"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (errors.WorkerDeadlineError, "a {role} worker did not answer in time"),
}


def status_for(exc: BaseException) -> grpc.StatusCode:
    for kind, code in STATUS_OF:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def worker_failure(exc: grpc.aio.AioRpcError, role: str, address: str, logged: bool = True) -> errors.TandemError:
    """The error a client of the coordinator sees for a failed worker call (see the module doc); ``logged``: the
    failure is logged as a warning here (a caller that expects it logs it its own way)."""
    code = exc.code()
    if logged:
        # A full KV pool is flow control, not a fault: the request is preempted and comes back (counted in
        # tandem_coordinator_preemptions_total). Under a burst it is refused hundreds of times a minute.
        full = code == grpc.StatusCode.RESOURCE_EXHAUSTED and (exc.details() or "").startswith(KV_FULL_PREFIX)
        log.log(logging.DEBUG if full else logging.WARNING, "%s worker %s: %s: %s", role, address, code.name,
                exc.details())
    kind, message = _WORKER_FAILURES.get(
        code, (errors.InternalError, "a {role} worker refused an internal call (" + code.name + ")"))
    return kind(message.format(role=role))


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions escaping a handler into the status code they stand for.

    Unexpected exceptions become INTERNAL and are logged with their traceback;
    expected ones (bad input, unknown sequence...) are not logged as errors.
    The request is parsed inside the handler, not by gRPC: a message that does
    not parse is the caller's bad input (INVALID_ARGUMENT, saying why), where
    gRPC's own parse would answer UNKNOWN ("Unexpected DecodeError").
    """

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method, parse = details.method, handler.request_deserializer
        return rewrap(handler, lambda behavior: _wrap_unary(behavior, method, parse),
                      lambda behavior: _wrap_stream(behavior, method, parse), request_deserializer=None)


def _parsed(parse: Callable[[bytes], Any] | None, request: Any) -> Any:
    """The request message from its bytes; a malformed one is the caller's ``InvalidRequestError``."""
    if parse is None or not isinstance(request, bytes):
        return request
    try:
        return parse(request)
    except Exception as exc:  # noqa: BLE001 - DecodeError, or anything a parser raises on garbage
        raise errors.InvalidRequestError(f"malformed request: {exc}") from None


def internal_message(exc: BaseException, method: str) -> str:
    """What the caller is told of an INTERNAL failure; the details go to the log under the same error id."""
    error_id = uuid.uuid4().hex[:16]
    log.error("internal error %s in %s: %s: %s", error_id, method, type(exc).__name__, exc, exc_info=exc)
    said = str(exc) if isinstance(exc, errors.InternalError) and str(exc) else "internal error"
    return f"{said} (error id {error_id}; the server's log has the details)"


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    code = status_for(exc)
    message = internal_message(exc, method) if code == grpc.StatusCode.INTERNAL else str(exc) or type(exc).__name__
    await context.abort(code, message)


def _wrap_unary(behavior: Callable[..., Any], method: str, parse: Callable[[bytes], Any] | None) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(_parsed(parse, request), context)
        except grpc.aio.AbortError:
            raise  # the servicer chose its status itself
        except Exception as exc:  # noqa: BLE001 - status_for maps it; anything unexpected is INTERNAL, logged
            await _abort(context, exc, method)

    return wrapped


def _wrap_stream(behavior: Callable[..., Any], method: str, parse: Callable[[bytes], Any] | None) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for item in behavior(_parsed(parse, request), context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - see _wrap_unary
            await _abort(context, exc, method)

    return wrapped
