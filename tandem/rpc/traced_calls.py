"""A worker's side of a traced request: each call that carries ``traceparent`` runs inside a span of its own.

The span (``TargetWorker/Verify``, SERVER) is a child of the coordinator's
request span named in the call's metadata (``tandem.tracing``), and says what
the batcher did with the call (``tandem.rpc.call_timing``): how long it waited
for its step, how many steps it took, how many other calls shared its last one
and how long the model computed. Calls without ``traceparent`` (Info polls, a
coordinator with tracing off) run as they are, with no span and no record.

It runs inside the error mapping (``tandem.rpc.status``), so a failed call's
span carries the exception as it escaped the handler, before it became a status.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from tandem.rpc.call_timing import CURRENT_CALL, CallTiming
from tandem.rpc.handlers import Behavior, rewrap
from tandem.tracing import Tracing, carrier


class TracedCalls(grpc.aio.ServerInterceptor):
    def __init__(self, tracing: Tracing, role: str) -> None:
        self.tracing = tracing
        self.role = role  # "target" or "draft": the span's ``tandem.role``

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not self.tracing.enabled:
            return handler
        headers = carrier(details.invocation_metadata)
        if not headers:
            return handler
        service, _, method = details.method.lstrip("/").partition("/")
        name = f"{service.rsplit('.', 1)[-1]}/{method}"  # "TargetWorker/Verify"
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method, "tandem.role": self.role}
        return rewrap(handler, lambda behavior: self._unary(behavior, name, headers, attributes),
                      lambda behavior: behavior)

    def _unary(self, behavior: Behavior, name: str, headers: dict[str, str], attributes: dict[str, Any]) -> Behavior:
        async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with self.tracing.call(name, headers, {**attributes, **_request_attributes(request)}) as span:
                timing = CallTiming()
                token = CURRENT_CALL.set(timing)
                try:
                    return await behavior(request, context)
                finally:
                    CURRENT_CALL.reset(token)
                    if span is not None:
                        span.set_attributes(timing.attributes())
        return traced


def _request_attributes(request: Any) -> dict[str, Any]:
    """What a span says of the call's message: its sequence and sizes, never its tokens."""
    found: dict[str, Any] = {}
    seq_id = getattr(request, "seq_id", "")
    if seq_id:
        found["tandem.seq_id"] = seq_id
    for field, attribute in (("token_ids", "tandem.prompt_tokens"), ("draft_tokens", "tandem.draft_tokens"),
                             ("new_tokens", "tandem.new_tokens")):
        values = getattr(request, field, None)
        if values is not None and not isinstance(values, (str, bytes)):
            found[attribute] = len(values)
    for field in ("committed_len", "k", "propose"):
        value = getattr(request, field, None)
        if isinstance(value, int) and not isinstance(value, bool):
            found[f"tandem.{field}"] = value
    return found
