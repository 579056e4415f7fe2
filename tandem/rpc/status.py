"""One place that maps domain errors to gRPC status codes, and back.

Servers install ``ErrorMappingInterceptor`` so a servicer simply raises
``InvalidRequestError`` and the client sees INVALID_ARGUMENT with the same
message. Clients call ``domain_error`` to turn an ``AioRpcError`` back into the
domain error, so the coordinator handles a worker's NOT_FOUND the way it
would handle an in-process ``UnknownSequenceError``.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

import grpc

from tandem import errors

log = logging.getLogger(__name__)

# Most specific first: the first isinstance match wins.
STATUS_OF: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.UnknownSequenceError, grpc.StatusCode.NOT_FOUND),
    (errors.InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.KVCacheExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.ShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (errors.WorkerUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.WorkerDeadlineError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.StaleSequenceError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ModelFileError, grpc.StatusCode.FAILED_PRECONDITION),
)

ERROR_OF: dict[grpc.StatusCode, type[errors.TandemError]] = {
    grpc.StatusCode.NOT_FOUND: errors.UnknownSequenceError,
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.KVCacheExhaustedError,
    grpc.StatusCode.UNAVAILABLE: errors.WorkerUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.WorkerDeadlineError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.StaleSequenceError,
}


def status_for(exc: BaseException) -> grpc.StatusCode:
    for kind, code in STATUS_OF:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def domain_error(exc: grpc.aio.AioRpcError, peer: str) -> errors.TandemError:
    """The domain error a worker's status stands for, naming the worker."""
    kind = ERROR_OF.get(exc.code(), errors.WorkerUnavailableError)
    return kind(f"{peer}: {exc.details() or exc.code().name}")


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions escaping a handler into the status code they stand for.

    Unexpected exceptions become INTERNAL and are logged with their traceback;
    expected ones (bad input, unknown sequence...) are not logged as errors.
    """

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("unexpected error in %s", method, exc_info=exc)
    await context.abort(code, str(exc) or type(exc).__name__)


def _wrap_unary(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except (errors.TandemError, ValueError) as exc:
            await _abort(context, exc, method)
        except Exception as exc:  # noqa: BLE001 - anything else is INTERNAL, with a log line
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc, method)

    return wrapped


def _wrap_stream(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for item in behavior(request, context):
                yield item
        except (errors.TandemError, ValueError) as exc:
            await _abort(context, exc, method)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc, method)

    return wrapped
