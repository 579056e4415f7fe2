"""OpenAI's Responses API request (``POST /v1/responses``), read as the chat completion it asks for.

A Responses request is a conversation (``input``: a string, or message, ``function_call`` and
``function_call_output`` items; ``instructions`` a system turn before it), the same sampling and
tools, and a ``text.format`` for structured output. So it is rewritten here into a chat completions
body and parsed by ``coordinator.http.schema.parse_chat``: one validation, one request path; errors
are renamed to this API's fields (``input``, ``max_output_tokens``, ``text.format``).

Left out, ``max_output_tokens`` is what the context leaves after the conversation (OpenAI's default; agent
SDKs set none), not the coordinator's ``--max-new-tokens``; ``--max-new-tokens-limit`` still bounds it.

``include: ["message.output_text.logprobs"]`` asks the output text's log-probabilities, with
``top_logprobs`` (0-20) alternatives per token; other includables name outputs Tandem does not make.

Tandem keeps no responses: ``previous_response_id`` and ``store: true`` are refused by name (send the
whole conversation in ``input``), as are built-in tools (web search, files...), reasoning and
other item types. ``n`` does not exist here: one output per request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from coordinator.http.errors import ApiError, bad_field, unsupported
from coordinator.http.schema import ParsedRequest, metadata, parse_chat
from tandem.sampling_params import MAX_LOGPROBS

LOGPROBS = "message.output_text.logprobs"  # the one includable Tandem makes
# Fields of this API with the chat completion field they become (None: this module reads them itself).
PASSED = ("model", "temperature", "top_p", "stream", "user", "parallel_tool_calls", "tandem", "seed",
          "frequency_penalty", "presence_penalty", "logit_bias", "structured_outputs", "prompt_cache_key",
          "safety_identifier", "priority")
NEUTRAL = {  # fields that ask for nothing at these values
    "store": (None, False), "truncation": (None, "disabled"), "reasoning": (None,),
    "service_tier": (None, "auto", "default"), "background": (None, False), "stream_options": (None, {}),
    "prompt_cache_retention": (None, "in_memory"),
}
WHY_REFUSED = {
    "store": "Tandem keeps no responses: send store: false or leave it out",
    "previous_response_id": "Tandem keeps no responses: send the whole conversation in input",
    "conversation": "Tandem keeps no conversations: send the whole conversation in input",
    "background": "responses run while the request is open",
}
# Chat completion fields, as this API names them, in errors.
RENAMED = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"),
           ("tool_choice.function", "tool_choice"))


@dataclass(slots=True)
class ResponsesRequest:
    """A parsed Responses request: the chat request it runs as, and what the response echoes back."""

    parsed: ParsedRequest
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats


def parse_responses(data: dict[str, Any], request_id: str = "") -> ResponsesRequest:
    body = dict(data)
    chat: dict[str, Any] = {name: body.pop(name) for name in PASSED if name in body}
    echo = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"), "temperature": data.get("temperature"),
            "parallel_tool_calls": data.get("parallel_tool_calls", True), "top_p": data.get("top_p"),
            "text": body.get("text") or {"format": {"type": "text"}}}
    for name, why in WHY_REFUSED.items():
        if name in body and body[name] not in NEUTRAL.get(name, (None,)):
            raise bad_field(name, why)
        body.pop(name, None)
    for name, neutral in NEUTRAL.items():
        value = body.pop(name, None)
        if neutral is not None and value not in neutral:
            raise unsupported(name)
    _logprobs(chat, body.pop("include", None), body.pop("top_logprobs", None))
    echo["top_logprobs"] = chat.get("top_logprobs", data.get("top_logprobs"))
    metadata(body.pop("metadata", None))
    messages = _instructions(body.pop("instructions", None)) + _input(body.pop("input", None))
    chat["messages"] = messages
    up_to_context = body.get("max_output_tokens") is None  # OpenAI's default: as long as the model may write
    if "max_output_tokens" in body:
        chat["max_completion_tokens"] = body.pop("max_output_tokens")
    tools = body.pop("tools", None)
    if tools is not None:
        chat["tools"] = _tools(tools)
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body.pop("tool_choice"))
    text = body.pop("text", None)
    if text is not None:
        fmt = _format(text)
        if fmt is not None:
            chat["response_format"] = fmt
    if body:
        key = next(iter(body))
        raise ApiError(400, f"{key}: unknown field", key, code="unknown_parameter")
    try:
        parsed = parse_chat(chat, request_id)
    except ApiError as exc:
        raise _renamed(exc) from None
    parsed.request.stopping.up_to_context = up_to_context
    parsed.params = {service: _rename(name) for service, name in parsed.params.items()}
    parsed.params.setdefault("prompt", "input")
    parsed.params.setdefault("messages", "input")
    parsed.params["stopping.max_new_tokens"] = "max_output_tokens"
    parsed.params.setdefault("response_format", "text.format")
    return ResponsesRequest(parsed, echo)


def _logprobs(chat: dict[str, Any], include: Any, top: Any) -> None:
    """``include: ["message.output_text.logprobs"]`` asks each output token's log-probability, with ``top_logprobs``
    alternatives (0-20); as OpenAI's, ``top_logprobs`` alone returns none. Other includables name outputs Tandem
    does not make (searches, images, reasoning), so they are refused."""
    if include is not None and not isinstance(include, list):
        raise bad_field("include", "a list of what to add to the output")
    for i, name in enumerate(include or []):
        if name != LOGPROBS:
            raise unsupported(f"include[{i}]", f" ({name!r}: only {LOGPROBS!r})")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS):
        raise bad_field("top_logprobs", f"an integer from 0 to {MAX_LOGPROBS}, got {top!r}")
    if LOGPROBS in (include or []):
        chat["logprobs"] = True
        chat["top_logprobs"] = top or 0


def _instructions(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, str):
        raise bad_field("instructions", "a string: the system message before the input")
    return [{"role": "system", "content": value}]


def _input(value: Any) -> list[dict[str, Any]]:
    """The conversation as chat messages: a string is one user turn; items in order, consecutive function calls
    joined into the assistant turn that made them."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_field("input", "required: a string, or a non-empty list of input items")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_field(where, "an input item (an object)")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(where, item))
        elif kind == "function_call":
            call = {"id": _text(where, item, "call_id"), "type": "function",
                    "function": {"name": _text(where, item, "name"), "arguments": _text(where, item, "arguments")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": _text(where, item, "call_id"), "content": output})
        else:
            raise unsupported(f"{where}.type", f" ({kind!r}: messages, function_call and function_call_output "
                                               "items only)")
    return messages


def _message(where: str, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise bad_field(f"{where}.role", f"one of user, system, developer, assistant, got {role!r}")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                raise unsupported(f"{where}.content[{j}].type", f" ({kind!r}: text parts only)")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise bad_field(f"{where}.content", "a string, or a list of text parts")
    return {"role": role, "content": content}


def _text(where: str, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_field(f"{where}.{key}", "required: a string")
    return value


def _tools(value: Any) -> list[dict[str, Any]]:
    """Function tools, flat as this API writes them, nested as chat completions do."""
    if not isinstance(value, list):
        raise bad_field("tools", "a list of tools")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise unsupported(f"tools[{i}].type", f" ({kind!r}: function tools only)")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if unknown:
            key = sorted(unknown)[0]
            raise ApiError(400, f"tools[{i}].{key}: unknown field", f"tools[{i}].{key}", code="unknown_parameter")
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict):
        if value.get("type") != "function" or not isinstance(value.get("name"), str):
            raise bad_field("tool_choice", "'none', 'auto', 'required' or {type: function, name}")
        return {"type": "function", "function": {"name": value["name"]}}
    return value


def _format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad_field("text", "an object with format")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_field("text.format", "an object: {type: text | json_object | json_schema, ...}")
    kind = fmt.get("type")
    if kind == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "description", "strict") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise bad_field("text.format.type", f"one of text, json_object, json_schema, got {kind!r}")


def _rename(name: str) -> str:
    for chat, ours in RENAMED:
        if name == chat or name.startswith(chat + ".") or name.startswith(chat + "["):
            return ours + name[len(chat):] if chat != "messages" else ours
    return name


def _renamed(exc: ApiError) -> ApiError:
    """A chat completion's refusal, as this API names the field."""
    if exc.param is None:
        return exc
    param = _rename(exc.param)
    message = exc.message.replace(exc.param, param, 1) if exc.message.startswith(exc.param) else exc.message
    return ApiError(exc.status, message, param, kind=exc.kind, code=exc.code)
