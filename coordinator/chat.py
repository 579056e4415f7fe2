"""A chat request's conversation and tools, from the wire to what the chat template and the parser take.

The turns are checked here (roles, which turn may carry calls or a call's id, arguments that are JSON
objects) and become the dicts ``apply_chat_template`` renders; the tools become a ``ToolUse``
(``tandem.tool_calls``), whose rules (names, choice) are checked where it is built.
"""

from __future__ import annotations

import json
from typing import Any

from tandem.errors import InvalidRequestError
from tandem.tool_calls import ToolCall, ToolSpec, ToolUse
from tandem.v1 import generation_pb2

CHAT_ROLES = ("system", "user", "assistant", "tool")  # the turns of a conversation (``messages``)


def conversation(messages: Any) -> list[dict[str, Any]]:
    """The request's turns as a chat template takes them; what no template could take is refused, named."""
    if not messages:
        raise InvalidRequestError("messages: the conversation is empty")
    turns = []
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidRequestError(f"messages[{i}].role: one of {', '.join(CHAT_ROLES)}, got {message.role!r}")
        turn: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.name:
            turn["name"] = message.name
        if message.tool_calls:
            if message.role != "assistant":
                raise InvalidRequestError(f"messages[{i}].tool_calls: only an assistant turn makes calls")
            turn["tool_calls"] = [_earlier_call(f"messages[{i}].tool_calls[{j}]", call).template_entry()
                                  for j, call in enumerate(message.tool_calls)]
        if message.tool_call_id:
            if message.role != "tool":
                raise InvalidRequestError(f"messages[{i}].tool_call_id: only a tool turn answers a call")
            turn["tool_call_id"] = message.tool_call_id
        turns.append(turn)
    return turns


def tool_use(options: generation_pb2.ToolOptions) -> ToolUse:
    """The request's tools, validated (``tools.*`` fields named in errors)."""
    specs = []
    for i, tool in enumerate(options.tools):
        parameters = None
        if tool.parameters:
            try:
                parameters = json.loads(tool.parameters)
            except ValueError as exc:
                raise InvalidRequestError(f"tools[{i}].parameters: not JSON ({exc})") from None
        specs.append(ToolSpec(tool.name, tool.description, parameters))
    return ToolUse(tuple(specs), options.choice or "auto", options.function, options.single_call)


def _earlier_call(where: str, call: generation_pb2.ToolCall) -> ToolCall:
    if not call.name:
        raise InvalidRequestError(f"{where}.name: required")
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError as exc:
        raise InvalidRequestError(f"{where}.arguments: not JSON ({exc})") from None
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"{where}.arguments: a JSON object, got {type(arguments).__name__}")
    return ToolCall(call.id, call.name, call.arguments or "{}")


class TemplateVariablesError(Exception):
    """The chat template failed on the client's own variables (``chat_template_kwargs``): the client's fault."""


def chat_template_refusals(encode: Any, kwargs: dict[str, Any] | None = None) -> Any:
    """Run ``encode``; the chat template refusing the client's messages is a ``ValueError`` naming why.

    A template stops on messages it does not take (``raise_exception("Conversation roles must
    alternate...")``, a field it needs): that is the request's fault and the template's message
    says what to change. A template that fails otherwise while rendering the client's ``kwargs`` (text
    where it multiplies a number) is ``TemplateVariablesError``. A template that does not parse, or fails
    with no client variables, is the model's, not the client's: INTERNAL.
    """
    try:
        return encode()
    except Exception as exc:
        if _is_template_refusal(exc):
            raise ValueError(f"the model's chat template refused this prompt: {exc}") from None
        if kwargs and not isinstance(exc, ValueError):
            raise TemplateVariablesError(f"the chat template failed with these variables "
                                         f"({type(exc).__name__}: {exc})") from None
        raise


def _is_template_refusal(exc: Exception) -> bool:
    try:
        from jinja2 import TemplateError, TemplateSyntaxError  # what transformers renders chat templates with
    except ImportError:
        return False
    return isinstance(exc, TemplateError) and not isinstance(exc, TemplateSyntaxError)
