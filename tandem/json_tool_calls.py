"""Calls a model writes as plain JSON instead of in ``<tool_call>`` blocks, found in ``auto``'s content.

Qwen2.5-Coder's chat template shows it its tools and asks for Hermes blocks, but the model was not
trained on them: left free, it writes its call as JSON, in a Markdown fence or bare (the 1.5B on
``data/tool_tasks``: no block in 14 answers; 10 calls found so, benchmarks/README.md; vLLM's Hermes
parser leaves these as content too, vLLM issue #32926). An agent then sees no call and stops. So,
beside the Hermes parser, the content is scanned for two shapes, and nothing else:

- a Markdown fence opened with json or nothing after its backticks, whose whole body is a call, or a
  list of calls;
- an answer that starts (after whitespace) with such a JSON value, with or without text after it.

A call here is an object with a ``name`` that is one of the request's tools and nothing but
``arguments`` (or ``parameters``) beside it, an object: ``{"name": "get_weather", "arguments": {...}}``.
Wrapped in one more pair of braces, ``{{"name": ..., "arguments": {...}}}``, it is a call too
(``loads_call_json``): Qwen2.5-Coder's own template shows the format so, and the model copies it.
A JSON example in prose, another object or a tool the request did not offer stays content, as
written. Calls found so arrive whole, with no argument deltas before them.

Streaming holds back only what may still become a call: a JSON fence until it closes, a bare
answer's JSON value until its brackets close, a possible fence opening at the end of a piece, and
whitespace that would sit next to a call. Any other fence (a python block) streams as it
comes; so does a JSON fence from its first character that is not ``{`` or ``[``.

Torch-free and proto-free, like ``tandem.tool_calls``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tandem.tool_call_deltas import StreamedArguments

CALL_KEYS = frozenset({"name", "arguments", "parameters"})
JSON_INFOS = ("", "json")  # fence info strings that may hold a call
MAX_INFO = 32  # a fence's opening line longer than this is not ```json
_FENCE_OPEN = re.compile(r"(?<=\n)[ \t]*```")  # a fence at the start of a line
_FENCE_CLOSE = re.compile(r"\n[ \t]*```[ \t]*(?:\n|\Z)")
_PARTIAL_FENCE = re.compile(r"\n[ \t]*`{0,2}\Z")  # the end of a piece that may become a fence's opening


def loads_call_json(text: str) -> Any:
    """``text`` decoded as JSON; where that fails and it is one JSON value wrapped in one more pair of braces,
    that value. Raises ValueError for anything else.

    Why the doubled braces: Qwen2.5-Coder's chat template (as its GGUF ships it) prints the call's format
    from a Jinja string literal, where ``{{`` is not an expression, so the model is shown
    ``{{"name": <function-name>, "arguments": <args-json-object>}}`` and sometimes writes exactly that
    (the 1.5B under pydantic-ai's agent, and for one of 14 ``data/tool_tasks`` requests under a system
    message). That is the format its template asks for, so it is read as the call it means; what the
    braces wrap must still be a call for the callers to take it."""
    try:
        return json.loads(text)
    except ValueError:
        inner = text.strip()
        if not (inner.startswith("{{") and inner.endswith("}}")):
            raise
        return json.loads(inner[1:-1])


def call_of(value: Any) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a decoded call object (``tandem.tool_calls.parse_call``'s rule: a name,
    and arguments as an object, an object's JSON text, or none); None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))  # some Hermes models write "parameters"
    if isinstance(arguments, str):  # arguments already as text: kept if it is an object's
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def calls_in(value: Any, names: frozenset[str]) -> list[tuple[str, str]] | None:
    """(name, arguments as JSON text) of each call ``value`` (a decoded JSON value) is; None unless every one is:
    an object naming one of ``names``, with nothing but its arguments beside the name."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not set(item) <= CALL_KEYS or item.get("name") not in names or (
                "arguments" in item and "parameters" in item):
            return None
        call = call_of(item)
        if call is None:
            return None
        calls.append(call)
    return calls or None


@dataclass(frozen=True, slots=True)
class _Span:
    start: int
    end: int
    line_ended: bool  # the match ends with a line break (a closing fence's line is complete)


class JsonCallFinder:
    """A content stream split again, into content and calls written as plain JSON (see the module docstring).

    ``feed(text, final)`` returns (content it completes, calls it completes, each ``(name, arguments)``).
    Without any such call the content is exactly the text fed, only later where it was held.
    """

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self._held = ""  # text not decided yet
        self._mode = "start"  # start | text | fence_head | fence_body | other_fence | bare
        self._ws = 0  # fence modes: the whitespace before the fence, held at the front of _held
        self._body = 0  # fence_body: where the fence's body starts in _held
        self._line_start = True  # whether _held starts a line
        self._scan: StreamedArguments | None = None  # bare: where the answer's JSON value closes
        self._scanned = 0  # bare: _held's characters scanned
        self._after_call = False  # whitespace right after a call is dropped
        self.found = 0  # calls found so far

    def feed(self, text: str, final: bool = False) -> tuple[str, list[tuple[str, str]]]:
        self._held += text
        out: list[str] = []
        calls: list[tuple[str, str]] = []
        while self._step(out, calls, final):
            pass
        if final:
            rest, self._held, self._mode = self._held, "", "text"
            if not (self.found and not rest.strip()):
                out.append(rest)
        return "".join(out), calls

    # ----- one step: True when it changed the mode (and may go on) -----
    def _step(self, out: list[str], calls: list[tuple[str, str]], final: bool) -> bool:
        if self._after_call:
            self._held = self._held.lstrip()
            if not self._held:
                return False
            self._after_call, self._line_start = False, True
        return getattr(self, "_" + self._mode)(out, calls, final)

    def _start(self, out, calls, final) -> bool:
        stripped = self._held.lstrip()
        if not stripped:
            return False
        self._mode = "bare" if stripped[0] in "{[" else "text"
        return True

    def _bare(self, out, calls, final) -> bool:
        begin = len(self._held) - len(self._held.lstrip())
        if self._scan is None:  # (the arguments scanner: strings, escapes, nesting; each character read once)
            self._scan, self._scanned = StreamedArguments("", "", begin), begin
        self._scanned += len(self._scan.advance(self._held))
        if not self._scan.done and not final:
            return False  # its brackets are still open
        found = None
        end = self._scanned
        if self._scan.done:
            try:
                found = calls_in(loads_call_json(self._held[begin:end]), self.names)
            except ValueError:
                pass
        if found is None:  # not a call: content, as written, and the answer goes on as text
            self._mode = "text"
            return True
        self._take(calls, found, end)
        return True

    def _text(self, out, calls, final) -> bool:
        fence = self._search(_FENCE_OPEN)
        if fence is not None:
            before = self._held[:fence.start]
            kept = before.rstrip()
            self._emit(out, kept)
            self._held = self._held[len(kept):]
            self._ws, self._mode = len(before) - len(kept), "fence_head"
            return True
        if final:
            cut = len(self._held)
        else:  # a fence may still open at the end; the whitespace before it would then not be content
            partial = self._search(_PARTIAL_FENCE)
            cut = len(self._held[:len(self._held) if partial is None else partial.start].rstrip())
        self._emit(out, self._held[:cut])
        self._held = self._held[cut:]
        return False

    def _fence_head(self, out, calls, final) -> bool:
        newline = self._held.find("\n", self._ws + 1)  # (the whitespace may hold the line break before the fence)
        head = self._held[self._ws:] if newline < 0 else self._held[self._ws:newline]
        info = head.strip()[3:].strip().lower()
        if newline < 0 and len(head) <= MAX_INFO and not final:
            return False
        if newline >= 0 and info in JSON_INFOS:
            self._body, self._mode = newline + 1, "fence_body"
            return True
        self._pass_fence(out, len(self._held) if newline < 0 else newline + 1)
        return True

    def _fence_body(self, out, calls, final) -> bool:
        close = _FENCE_CLOSE.search(self._held, self._body - 1)
        if close is None or (close.end() == len(self._held) and not final and not close.group().endswith("\n")):
            body = self._held[self._body:].lstrip()
            if body and body[0] not in "{[":  # not JSON: a plain code block after all
                self._pass_fence(out, len(self._held))
                return True
            if not final:
                return False
            end, body = len(self._held), self._held[self._body:]  # cut short: a call if its JSON is whole
        else:
            end, body = close.end(), self._held[self._body:close.start()]
        try:
            found = calls_in(loads_call_json(body), self.names)
        except ValueError:
            found = None
        if found is None:
            self._emit(out, self._held[:end])
            self._held, self._mode = self._held[end:], "text"
        else:
            self._take(calls, found, end)
        return True

    def _other_fence(self, out, calls, final) -> bool:
        close = self._search(_FENCE_CLOSE)
        if close is not None and (close.line_ended or final):
            self._emit(out, self._held[:close.end])
            self._held, self._mode, self._line_start = self._held[close.end:], "text", True
            return True
        partial = self._search(_PARTIAL_FENCE)
        cut = len(self._held) if final or partial is None else partial.start
        if close is not None:  # a closing line not yet ended: held until it is
            cut = min(cut, close.start)
        self._emit(out, self._held[:cut])
        self._held = self._held[cut:]
        return False

    # ----- helpers -----
    def _search(self, pattern: re.Pattern[str]) -> _Span | None:
        """``pattern``'s first match in ``_held``, seen with what comes before ``_held``: a line
        break if it starts a line (so that a fence at its very start counts), else a character that is none."""
        match = pattern.search(("\n" if self._line_start else "\x00") + self._held)
        if match is None:
            return None
        return _Span(max(0, match.start() - 1), match.end() - 1, match.group().endswith("\n"))

    def _pass_fence(self, out: list[str], upto: int) -> None:
        """The fence opened is not a call: what is held of it up to ``upto`` is content, and its body streams."""
        self._emit(out, self._held[:upto])
        self._held, self._mode = self._held[upto:], "other_fence"

    def _take(self, calls: list[tuple[str, str]], found: list[tuple[str, str]], end: int) -> None:
        """Calls made of ``_held[:end]``: its text (and the whitespace around it) is not content."""
        calls.extend(found)
        self.found += len(found)
        self._held, self._mode, self._after_call = self._held[end:], "text", True

    def _emit(self, out: list[str], text: str) -> None:
        if text:
            out.append(text)
            self._line_start = text.endswith("\n")
