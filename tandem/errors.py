"""Domain errors shared by every role.

Each maps to one gRPC status code at the service edge (see the interceptor in
``tandem.rpc``), so the engine never needs to know about gRPC.
"""

from __future__ import annotations

from collections.abc import Iterable


class TandemError(Exception):
    """Base class of every error Tandem raises on purpose."""


class InvalidRequestError(TandemError, ValueError):
    """The caller sent something we cannot serve (maps to INVALID_ARGUMENT)."""


class ContextLengthError(InvalidRequestError):
    """A prompt, or a prompt and the answer asked for, longer than the server serves (INVALID_ARGUMENT; HTTP 400
    with OpenAI's code ``context_length_exceeded``). Its message says "this model's maximum context length is N
    tokens", as OpenAI's and vLLM's do: clients that trim a conversation or fall back to a larger model when it
    overflows (LiteLLM's ContextWindowExceededError, agent frameworks) recognise the overflow by that sentence."""


class PromptTooLongError(ContextLengthError):
    """A prompt alone longer than the server takes or the model's context."""


class UnsupportedArchitectureError(InvalidRequestError):
    """A checkpoint's architecture is not one our engine implements."""


class ModelFileError(TandemError):
    """A model file is missing, truncated, or does not match its checksum."""


class KVCacheExhaustedError(TandemError):
    """The paged KV pool has no free block left for a request (RESOURCE_EXHAUSTED)."""


class UnknownSequenceError(TandemError, KeyError):
    """A call names a sequence the worker does not hold (maps to NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError would print the repr with quotes
        return str(self.args[0]) if self.args else "unknown sequence"


class ListenError(TandemError):
    """A server cannot listen where it was told to (the port is in use, or the host is not this machine's)."""


class UnauthenticatedError(TandemError):
    """A call to the public API without a valid bearer token (maps to UNAUTHENTICATED)."""


class ClientLimitError(TandemError):
    """A client is over its own limit, e.g. of concurrent requests (maps to RESOURCE_EXHAUSTED)."""


class ShuttingDownError(TandemError):
    """The server is draining after SIGTERM and takes no new work (maps to UNAVAILABLE)."""


class WorkerUnavailableError(TandemError):
    """A worker did not answer, or answered UNAVAILABLE (maps to UNAVAILABLE)."""


class WorkerDeadlineError(TandemError):
    """A worker did not answer within the call's deadline (maps to DEADLINE_EXCEEDED)."""


class StaleSequenceError(TandemError):
    """A call's committed length does not fit what the worker holds (maps to FAILED_PRECONDITION)."""


class InternalError(TandemError):
    """Something inside Tandem failed that the caller did not cause (maps to INTERNAL).

    A worker refusing one of the coordinator's internal calls (an unknown or
    stale sequence, a field the coordinator got wrong) reaches the client as
    this, never as the client's own INVALID_ARGUMENT or NOT_FOUND.
    """


def token_count_text(count: int, kind: str = "") -> str:
    """``count`` tokens, in words an error message can hold: "1 token", "5 new tokens"."""
    return f"{count} {kind}token{'' if count == 1 else 's'}"


def check_token_ids(field: str, ids: Iterable[int], vocab_size: int) -> None:
    """Raise ``InvalidRequestError`` naming ``field`` if any id falls outside ``0..vocab_size - 1``."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"{field}: token ids must be in 0..{vocab_size - 1}; got {bad[:5]}")
