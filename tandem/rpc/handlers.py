"""Rebuilding a gRPC method handler around new behaviour: what every server interceptor here does.

An interceptor gets the servicer's ``RpcMethodHandler`` and returns another
one of the same kind whose behaviour wraps the original. Only the kinds our
services define with a single request are wrapped (unary-unary, unary-stream);
others (reflection's bidirectional stream) pass through untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Behavior = Callable[..., Any]
_KEEP: Any = object()


def rewrap(handler: grpc.RpcMethodHandler, wrap_unary: Callable[[Behavior], Behavior],
           wrap_stream: Callable[[Behavior], Behavior], request_deserializer: Any = _KEEP) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour wrapped; ``request_deserializer`` replaces the original's if given."""
    parse = handler.request_deserializer if request_deserializer is _KEEP else request_deserializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), request_deserializer=parse,
                                                   response_serializer=handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream), request_deserializer=parse,
                                                    response_serializer=handler.response_serializer)
    return handler
