"""vLLM's tokenizer routes, so that a client can use the served model's tokenizer without having it.

- ``POST /tokenize``: ``{"prompt": text, "add_special_tokens": true}``, ``{"prompt": text, "suffix": text}`` (the
  fill-in-the-middle prompt completions' ``suffix`` sends, in the model's marker tokens), or ``{"messages": [...],
  "add_generation_prompt": true, "continue_final_message": false, "add_special_tokens": false,
  "chat_template_kwargs": {}, "tools": [...], "tool_choice": ...}`` (the chat template renders the turns and the
  tools, as chat completions do: ``tool_choice: "none"`` shows the model none), either with ``return_token_strs``;
  the reply is
  ``{"count", "max_model_len", "tokens"[, "token_strs"]}``.
- ``POST /detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}``.
- ``GET /tokenizer_info``: the tokenizer's class, special tokens, chat template and the served context.

lm-evaluation-harness reads them (its ``tokenizer_backend=remote``, chosen by itself when ``/tokenizer_info`` and
``/tokenize`` answer) to split a text's context from its continuation by token. Requests are parsed as the
completions' are (``coordinator.http.schema``): a field Tandem does not know is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coordinator.chat import TemplateVariablesError, chat_template_refusals, conversation
from coordinator.http.errors import ApiError, bad_field
from coordinator.http.fields import Fields
from coordinator.http.schema import INT32_MAX, chat_template_kwargs, parse_messages, parse_tools
from tandem.errors import InvalidRequestError, check_token_ids
from tandem.infill import InfillFormat, no_infill_message
from tandem.tokenizer import template_kwargs
from tandem.tool_calls import ToolUse
from tandem.v1 import generation_pb2

# The service's check of a request's tools (``GenerationService.tool_use``): what chat completions refuse, refused.
ToolCheck = Callable[[generation_pb2.ToolOptions], ToolUse | None]

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def tokenize(data: dict[str, Any], tokenizer: Any, max_context: int, infill: InfillFormat | None,
             tools: ToolCheck) -> dict[str, Any]:
    """The ``/tokenize`` reply to ``data``; ``infill``: the model's fill-in-the-middle format (None: it has none, and a
    ``suffix`` is refused naming it); ``tools``: how chat completions check tools."""
    body = Fields(data)
    body.string("model")  # checked by the caller against the served model
    strings = bool(body.boolean("return_token_strs"))
    if "messages" in body.data:
        if "prompt" in body.data:
            raise bad_field("prompt", "give a prompt or messages, not both")
        ids = _render(body, tokenizer, tools)
    else:
        if any(name in body.data for name in ("tools", "tool_choice")):
            raise bad_field("tools" if "tools" in body.data else "tool_choice",
                            "only with messages (a conversation's template shows the model its tools)")
        prompt = body.string("prompt")
        if prompt is None:
            raise bad_field("prompt", "required: the text to tokenize (or messages: a conversation)")
        special = body.boolean("add_special_tokens")
        suffix = body.string("suffix")
        if suffix:
            ids = _infill(prompt, suffix, special, tokenizer, infill)
        else:
            ids = list(tokenizer.encode(prompt, add_special_tokens=True if special is None else special))
    body.finish()
    reply: dict[str, Any] = {"count": len(ids), "max_model_len": max_context, "tokens": ids}
    if strings:
        reply["token_strs"] = list(tokenizer.convert_ids_to_tokens(ids))
    return reply


def _infill(prefix: str, suffix: str, special: bool | None, tokenizer: Any, fmt: InfillFormat | None) -> list[int]:
    """The fill-in-the-middle prompt completions' ``suffix`` sends (``tandem.infill``): what it counts, and whether
    it fits. The model's marker tokens decide what goes around the texts, so ``add_special_tokens`` has no say."""
    if special is not None:
        raise bad_field("add_special_tokens", "not with suffix: the model's fill-in-the-middle format decides the "
                                              "tokens around the texts; leave it out")
    if fmt is None:
        raise ApiError(400, no_infill_message("suffix"), "suffix")
    return fmt.prompt_ids(tokenizer, prefix, suffix)


def _render(body: Fields, tokenizer: Any, check_tools: ToolCheck) -> list[int]:
    """A conversation's tokens through the chat template, with its tools (what chat completions would send the
    model)."""
    turns = conversation(parse_messages(body.take("messages")))
    tools = _shown_tools(body, check_tools)
    generation = body.boolean("add_generation_prompt")
    final = bool(body.boolean("continue_final_message"))
    if final and generation:
        raise bad_field("continue_final_message", "cannot be set with add_generation_prompt: give one")
    special = bool(body.boolean("add_special_tokens"))
    try:
        kwargs = template_kwargs(chat_template_kwargs(body))
    except ValueError as exc:
        raise bad_field("chat_template_kwargs", str(exc)) from None
    if not getattr(tokenizer, "chat_template", None):
        raise bad_field("messages", "this model's tokenizer has no chat template: send a prompt instead")
    try:
        ids = chat_template_refusals(lambda: tokenizer.apply_chat_template(
            turns, tools=tools, add_generation_prompt=not final if generation is None else generation,
            continue_final_message=final, tokenize=True, add_special_tokens=special, **kwargs), kwargs)
    except ValueError as exc:  # the template refused these turns (or the final one cannot be continued)
        raise bad_field("messages", str(exc)) from None
    except TemplateVariablesError as exc:
        raise bad_field("chat_template_kwargs", str(exc)) from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5: a BatchEncoding


def _shown_tools(body: Fields, check: ToolCheck) -> list[dict[str, Any]] | None:
    """The tools the template shows the model, as chat completions give them (None: none shown); refused as chat
    completions refuse them (a template that cannot show them, a choice naming no tool...)."""
    request = generation_pb2.GenerateRequest()
    parse_tools(body, request)  # tools, tool_choice, parallel_tool_calls: parsed and named as a chat's are
    if not request.HasField("tools"):
        return None
    use = check(request.tools)
    return use.template_entries() if use is not None else None


def detokenize(data: dict[str, Any], tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    body = Fields(data)
    body.string("model")
    tokens = body.take("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_field("tokens", "required: a list of token ids")
    if not all(0 <= t <= INT32_MAX for t in tokens):
        raise bad_field("tokens", "token ids must be integers >= 0")
    try:
        check_token_ids("tokens", tokens, vocab_size)
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), "tokens") from None
    body.finish()
    return {"prompt": tokenizer.decode(tokens)}


def tokenizer_info(tokenizer: Any, max_context: int) -> dict[str, Any]:
    """As vLLM's: the tokenizer's class and special tokens (null where it has none), its chat template (the one
    the coordinator renders chats with), and the served context as ``model_max_length``."""
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for name in SPECIAL_TOKENS:
        token = getattr(tokenizer, name, None)
        info[name] = token if isinstance(token, str) else None
    info["chat_template"] = getattr(tokenizer, "chat_template", None)
    info["model_max_length"] = max_context
    return info
