"""Tool calls: the functions a chat request offers, the grammar of calls that must be made, and the calls
parsed back out of the model's text.

The format is Hermes' (Qwen2.5, Hermes, and the models trained on their data), the one the chat template
shows the model: each call is a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>``
and ``</tool_call>``, a call per block, blocks one after another. A model's template says whether it
renders tools this way (``HermesFormat.of``); a model whose template does not is served with a
``--chat-template`` that does, or refuses requests with tools by name.

- ``auto``: the model decides. Its text is parsed as it streams (``ToolCallParser``): what lies outside
  the blocks is the content, each complete block a call. Nothing constrains it, so a block that is not a
  call (not JSON, no name) stays in the content, as it was written. A model that writes its calls as plain
  JSON instead (Qwen2.5-Coder) has them found too, where they name the request's tools
  (``tandem.json_tool_calls``).
- ``required`` and a named function: the calls are enforced with a grammar (``HermesFormat.grammar``, in
  llguidance's Lark dialect, each block's JSON under its function's parameter schema), which the target
  applies to every row it verifies as it applies a JSON schema (``tandem.structured_output``). So the
  output is constrained target-only decoding's, drafts included, and always parses.
- ``none``: no call; the tools are not shown to the model.

Torch-free and proto-free: the coordinator uses it, and the HTTP edge converts OpenAI's JSON into these.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tandem.errors import InvalidRequestError
from tandem.json_tool_calls import JsonCallFinder, call_of, loads_call_json
from tandem.tool_call_deltas import StreamedArguments, ToolCallDelta

TOOL_CHOICES = ("auto", "none", "required", "function")
MAX_TOOLS = 128  # as OpenAI
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# A conversation rendered to see whether a chat template shows the model its tools, and in which format.
_PROBE_TOOL = "tandem_probe_function"


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A function the model may call; ``parameters`` is the JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: Any = None  # a JSON schema (a dict); None: any object

    def template_entry(self) -> dict[str, Any]:
        """As chat templates take it (OpenAI's ``tools[]`` item)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.schema
        return {"type": "function", "function": function}

    @property
    def schema(self) -> Any:
        return ANY_OBJECT if self.parameters is None else self.parameters


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call: ``arguments`` is a JSON object's text."""

    id: str
    name: str
    arguments: str

    def template_entry(self) -> dict[str, Any]:
        """As chat templates take an earlier turn's call: the arguments as an object (templates ``tojson`` it)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name,
                                                                "arguments": json.loads(self.arguments)}}


@dataclass(frozen=True, slots=True)
class ToolUse:
    """A request's tools and what it asks of them, validated."""

    tools: tuple[ToolSpec, ...]
    choice: str = "auto"  # TOOL_CHOICES
    function: str = ""  # choice "function": the one to call
    single_call: bool = False

    def __post_init__(self) -> None:
        if len(self.tools) > MAX_TOOLS:
            raise InvalidRequestError(f"tools: at most {MAX_TOOLS} tools, got {len(self.tools)}")
        seen: set[str] = set()
        for i, tool in enumerate(self.tools):
            if not NAME.fullmatch(tool.name):
                raise InvalidRequestError(f"tools[{i}].name: 1 to 64 of a-z, A-Z, 0-9, _ and -, got {tool.name!r}")
            if tool.name in seen:
                raise InvalidRequestError(f"tools[{i}].name: {tool.name!r} is given twice")
            seen.add(tool.name)
            if not isinstance(tool.schema, dict):
                raise InvalidRequestError(f"tools[{i}].parameters: a JSON schema (an object), got {tool.schema!r}")
        if self.choice not in TOOL_CHOICES:
            raise InvalidRequestError(f"tool_choice: one of {', '.join(TOOL_CHOICES)}, got {self.choice!r}")
        if self.choice in ("required", "function") and not self.tools:
            raise InvalidRequestError(f"tool_choice: {self.choice!r} needs tools to call")
        if self.choice == "function" and self.function not in seen:
            raise InvalidRequestError(f"tool_choice: no tool is named {self.function!r}")
        if self.choice != "function" and self.function:
            raise InvalidRequestError("tool_choice: a function is named only with choice 'function'")

    @property
    def shown(self) -> bool:
        """Whether the model sees the tools (and its text is parsed for calls)."""
        return bool(self.tools) and self.choice != "none"

    def template_entries(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template is given them: OpenAI's ``tools`` items; None where the model is shown none
        (``tool_choice: none``)."""
        return [t.template_entry() for t in self.tools] if self.shown else None

    @property
    def enforced(self) -> bool:
        """Whether calls must be made (a grammar enforces them)."""
        return self.choice in ("required", "function")

    def callable(self) -> tuple[ToolSpec, ...]:
        """The tools a call may name."""
        return tuple(t for t in self.tools if self.choice != "function" or t.name == self.function)


class HermesFormat:
    """Calls as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` blocks."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self, special_tags: bool) -> None:
        # Whether the tags are tokens of their own (Qwen's): a grammar must then name the tokens, since their
        # text alone would be spelled with other tokens, which the model never writes.
        self.special_tags = special_tags

    @classmethod
    def of(cls, tokenizer: Any) -> HermesFormat | None:
        """The format, if the tokenizer's chat template shows the model its tools and asks for Hermes calls."""
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or cls.OPEN not in template:
            return None
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tools=[ToolSpec(_PROBE_TOOL).template_entry()],
                add_generation_prompt=True, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that cannot render tools does not support them
            return None
        if _PROBE_TOOL not in text:
            return None
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        return cls(special_tags=cls.OPEN in added and cls.CLOSE in added)

    def grammar(self, use: ToolUse) -> str:
        """The Lark grammar (llguidance's dialect) of the calls ``use`` enforces: one call, or several unless
        ``single_call``; each block's JSON names a callable tool, with arguments under its
        schema. After the last block one newline may follow, then the grammar ends: the model's stop tokens end the
        text."""
        options = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.schema},
                    "required": ["name", "arguments"], "additionalProperties": False} for t in use.callable()]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        tag_open, tag_close = (self.OPEN, self.CLOSE) if self.special_tags else (
            json.dumps(self.OPEN), json.dumps(self.CLOSE))
        # The newlines the template shows around each block are allowed, not required: a call parses either way.
        # The one after the last block must be allowed on its own: a template ends its blocks with one before the
        # stop token, so a model writes it (Qwen2.5-Coder-1.5B: p = 1.0 after </tool_call>, then p = 1.0 for its
        # stop token), and a grammar that took it only before another block forced a copy of the call after it,
        # and another, up to max_tokens.
        start = 'start: call "\\n"?' if use.single_call else 'start: call ("\\n"? call)* "\\n"?'
        return (f'{start}\ncall: {tag_open} "\\n"? body "\\n"? {tag_close}\n'
                f"body: %json {json.dumps(schema, ensure_ascii=False)}\n")


def check_tool_schemas(use: ToolUse) -> None:
    """Each tool's parameter schema compiles to a grammar (llguidance's JSON schema compiler), else an error naming
    the tool: checked for every request that shows tools, whatever its choice, so that a schema no grammar can hold
    is named at once (about 0.12 ms a tool, on every request: not cached)."""
    import llguidance

    for i, tool in enumerate(use.tools):
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(tool.schema))
        except ValueError as exc:
            raise InvalidRequestError(f"tools[{i}].parameters: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise InvalidRequestError(f"tools[{i}].parameters: this schema cannot be enforced: {error}")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one block's text; None for text that is not a call. Its object may be
    wrapped in one more pair of braces, as Qwen2.5-Coder's template shows the format (``loads_call_json``)."""
    try:
        return call_of(loads_call_json(body))
    except ValueError:
        return None


class ToolCallParser:
    """A streamed text split into content and calls, as it arrives.

    ``feed`` takes the next piece of text and returns (the content it completes, the calls it completes);
    with ``final`` (the text's last piece) what was held back too. Held back: text that may be the start
    of a ``<tool_call>`` tag, a block until its ``</tool_call>``, and whitespace until text follows it
    (the blank lines around calls are not content). Without any call, the content is exactly the text.
    A call's arguments are streamed too while its block is open (``take_deltas``,
    ``tandem.tool_call_deltas``); the call then completes with the id its deltas had.

    Given the request's tool ``names`` (``auto``), the content is searched again for calls written as plain
    JSON, bare or in a ```json fence (``tandem.json_tool_calls``: Qwen2.5-Coder's way); those arrive whole.
    """

    def __init__(self, names: frozenset[str] = frozenset()) -> None:
        self._json = JsonCallFinder(names) if names else None
        self.open, self.close = HermesFormat.OPEN, HermesFormat.CLOSE  # the tags' text, whether tokens or not
        self._buffer = ""  # text not yet decided
        self._in_call = False
        self._spaces = ""  # whitespace held until text follows it
        self._after_call = False  # whitespace right after a call is dropped
        self.calls: list[ToolCall] = []  # every call so far
        self._streamed: StreamedArguments | None = None  # the open block's call, once its opening is in
        self._deltas: list[ToolCallDelta] = []  # not yet taken

    def take_deltas(self) -> list[ToolCallDelta]:
        """The pieces of calls streamed since the last take (each call's first names it)."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        content, calls = self._feed(text)
        if final:
            rest, more = self._finish()
            content, calls = content + rest, calls + more
        if self._json is not None:
            content, found = self._json.feed(content, final)
            for name, arguments in found:
                calls.append(ToolCall(new_call_id(), name, arguments))
                self.calls.append(calls[-1])
        return content, calls

    def _feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._buffer.find(self.close)
                if end < 0:
                    self._stream(self._buffer)
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(self.close):]
                self._in_call = False
                self._stream(body)
                call = self._call(body)
                if call is None:  # not a call: it stays text, as written
                    content += self._text(self.open + body + self.close)
                else:
                    calls.append(call)
                    self._spaces = ""  # the blank line before a call is not content
                    self._after_call = True  # nor the one after it
                continue
            start = self._buffer.find(self.open)
            if start >= 0:
                content += self._text(self._buffer[:start])
                self._buffer = self._buffer[start + len(self.open):]
                self._in_call = True
                continue
            keep = _partial_tag(self._buffer, self.open)
            content += self._text(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        return content, calls

    def _finish(self) -> tuple[str, list[ToolCall]]:
        """The rest: an unclosed block (the text ended inside it, e.g. at max_tokens) is a call if its JSON is
        complete, else text; held whitespace is content only if no call was made."""
        content, calls = "", []
        if self._in_call:
            self._stream(self._buffer)
            call = self._call(self._buffer)
            if call is None:
                content = self._text(self.open + self._buffer)
            else:
                calls.append(call)
        else:
            content = self._text(self._buffer)
        self._buffer, self._in_call = "", False
        if not self.calls:
            content += self._spaces
        self._spaces = ""
        return content, calls

    def _stream(self, body: str) -> None:
        """The open block's body so far: name its call once its opening is in, then pass on new arguments text."""
        if self._streamed is None:
            self._streamed = StreamedArguments.opening(body, new_call_id())
            if self._streamed is None:
                return
            named = self._streamed.name
        else:
            named = ""
        text = self._streamed.advance(body)
        if named or text:
            self._deltas.append(ToolCallDelta(self._streamed.call_id, named, text))

    def _call(self, body: str) -> ToolCall | None:
        """The closed block's call (with the id its deltas had, if it streamed); None for a block that is not one."""
        streamed, self._streamed = self._streamed, None
        parsed = parse_call(body.strip())
        if parsed is None:
            return None
        call = ToolCall(streamed.call_id if streamed is not None else new_call_id(), *parsed)
        self.calls.append(call)
        return call

    def _text(self, text: str) -> str:
        """Content to emit: held whitespace first, and this text's trailing whitespace held back."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if not text:
            return ""
        text = self._spaces + text
        body = text.rstrip()
        self._spaces = text[len(body):]
        return body


def parse_tool_calls(text: str, names: frozenset[str] = frozenset()) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole text (with ``names``, calls written as plain JSON too)."""
    return ToolCallParser(names).feed(text, final=True)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (it may be completed by what follows)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
