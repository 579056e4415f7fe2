"""Errors of the HTTP API in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with its status.

The request path is the gRPC API's (coordinator/service.py), so most refusals are
its domain errors (``tandem.errors``); ``from_domain`` gives each the HTTP status an
OpenAI client expects, and names the HTTP field where the service named its own
(``stopping.max_new_tokens`` is ``max_tokens`` here: the client sent that). What
the client did not cause is never detailed: an unexpected error is a 500 with an
error id, which the coordinator's log line carries with the traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem import errors
from tandem.rpc.status import internal_message

INVALID = "invalid_request_error"

# The service's field names (and a sampling parameter's own, inside "sampling: ..."), longest first where one is a
# prefix of another, and what the HTTP API calls them unless the request says otherwise (``ParsedRequest.params``).
SERVICE_FIELDS: tuple[tuple[str, str], ...] = (
    ("stopping.max_new_tokens", "max_tokens"),
    ("stopping.min_new_tokens", "min_tokens"),
    ("stopping.stop_strings", "stop"),
    ("stopping.stop_token_ids", "tandem.stop_token_ids"),
    ("speculation.method", "tandem.method"),
    ("speculation.tree", "tandem.tree"),
    ("speculation.heads_nodes", "tandem.heads_nodes"),
    ("speculation.k", "tandem.k"),
    ("speculation.prediction", "prediction"),
    ("token_ids.ids", "prompt"),
    ("request_id", "x-request-id"),
    ("cache_key", "prompt_cache_key"),
    ("truncate_prompt_tokens", "truncate_prompt_tokens"),
    ("priority", "priority"),
    ("messages.template_kwargs", "chat_template_kwargs"),
    ("messages", "messages"),
    ("prompt", "prompt"),
    ("text", "prompt"),
    ("infill", "suffix"),
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "tandem.top_k"),
    ("min_p", "min_p"),
    ("allowed_token_ids", "allowed_token_ids"),
    ("bad_words", "bad_words"),
    ("logprobs", "logprobs"),
    ("seed", "seed"),
    ("repetition_penalty", "repetition_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("presence_penalty", "presence_penalty"),
    ("logit_bias", "logit_bias"),
    ("response_format", "response_format"),
    ("grammar", "tool_choice"),  # a grammar the coordinator made: the tool calls that must be made
    ("tool_choice", "tool_choice"),
    ("tools", "tools"),
)


class ApiError(Exception):
    """A reply other than 200, as OpenAI's clients parse it."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = INVALID,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad_field(param: str, message: str, code: str | None = None) -> ApiError:
    """A 400 naming the request field that is wrong."""
    return ApiError(400, f"{param}: {message}", param, code=code)


def unsupported(param: str, why: str = "") -> ApiError:
    """A 400 for a field Tandem cannot honour (never ignored in silence)."""
    return ApiError(400, f"{param}: not supported by Tandem{why}; leave it out", param, code="unsupported_parameter")


def from_domain(exc: BaseException, params: Mapping[str, str] | None = None, where: str = "http") -> ApiError:
    """The HTTP error for one of the request path's exceptions; ``params``: the service's field names as this
    request called them (e.g. ``stopping.max_new_tokens`` -> ``max_completion_tokens``)."""
    if isinstance(exc, ApiError):
        return exc
    message = str(exc) or type(exc).__name__
    if isinstance(exc, errors.InvalidRequestError):
        param, message = _http_field(message, params or {})
        # (a 400 as OpenAI's and vLLM's: their clients catch an overflow as a bad request with this code)
        code = "context_length_exceeded" if isinstance(exc, errors.ContextLengthError) else None
        return ApiError(400, message, param, code=code)
    if isinstance(exc, errors.UnauthenticatedError):
        return ApiError(401, message, kind="authentication_error", code="invalid_api_key")
    if isinstance(exc, errors.ClientLimitError):
        return ApiError(429, message, kind="rate_limit_error", code="rate_limit_exceeded")
    if isinstance(exc, errors.ShuttingDownError):
        return ApiError(503, message, kind="service_unavailable_error", code="draining")
    if isinstance(exc, (errors.KVCacheExhaustedError, errors.WorkerUnavailableError)):
        return ApiError(503, message, kind="service_unavailable_error", code="overloaded")
    if isinstance(exc, errors.WorkerDeadlineError):
        return ApiError(504, message, kind="timeout_error", code="timeout")
    return ApiError(500, internal_message(exc, where), kind="server_error", code="internal_error")


def _http_field(message: str, params: Mapping[str, str]) -> tuple[str | None, str]:
    """(the HTTP field a service message names, the message naming it so)."""
    if message.startswith("sampling: "):  # "sampling: temperature must be ..." names the parameter after it
        message = message[len("sampling: "):]
    for field, default in SERVICE_FIELDS:
        rest = message[len(field):]
        if message.startswith(field) and rest[:1] in (":", " ", "[", ""):
            name = params.get(field, default)
            param = name + rest.partition(":")[0] if rest.startswith("[") else name  # "messages[2].role": the item
            return param, name + rest
    return None, message
