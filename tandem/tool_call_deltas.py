"""A tool call's arguments streamed as the model writes them, before its block closes.

OpenAI streams a call as deltas: the first names it (``id``, ``name``), the next ones add
``arguments`` text, which the client concatenates. A Hermes block's body is
``{"name": ..., "arguments": {...}}``; once its opening up to the arguments' first ``{`` is in
(``CALL_OPENING``), the call is named, and from there on every character of the arguments
object is passed on as it arrives, up to the brace that closes it (a small JSON scanner: string,
escape and nesting depth, so that a brace inside a string does not count). What follows the
arguments (the wrapper's ``}``, the newline) is not arguments text.

A block written otherwise (``arguments`` before ``name``, arguments as a string, Hermes'
``parameters``) streams nothing and arrives whole when it closes. In ``auto`` nothing constrains
the model: a block that opens as a call and then breaks (its JSON never closes) has streamed a
name and part of its arguments, and its text becomes content, as every block that is not a call
does (OpenAI's protocol cannot take a streamed call back). Calls a grammar enforces always parse.

Torch-free and proto-free, like ``tandem.tool_calls``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# A call's body up to its arguments' opening brace: {"name": "<a JSON string>", "arguments": {  (or {{"name": ...,
# the doubled braces Qwen2.5-Coder's template shows: tandem.json_tool_calls.loads_call_json)
CALL_OPENING = re.compile(r'\s*\{\s*(?:\{\s*)?"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*\{')


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a streamed call: the first of a call has its ``name``; ``arguments`` is text to append."""

    id: str
    name: str
    arguments: str


class StreamedArguments:
    """One block's arguments object, scanned as the block's body grows; ``advance`` gives the new text."""

    def __init__(self, call_id: str, name: str, start: int) -> None:
        self.call_id = call_id
        self.name = name
        self._pos = start  # the next body character to scan (the arguments' first ``{`` at first)
        self._depth = 0  # open objects and arrays
        self._in_string = False
        self._escape = False
        self.done = False  # the arguments object closed: nothing after it is arguments text

    @classmethod
    def opening(cls, body: str, call_id: str) -> StreamedArguments | None:
        """The stream of ``body``'s arguments, once its opening is in; None until then (or for a body written
        otherwise, which never matches)."""
        match = CALL_OPENING.match(body)
        if match is None:
            return None
        try:
            name = json.loads(f'"{match.group(1)}"')
        except ValueError:
            return None
        return cls(call_id, name, match.end() - 1) if name else None

    def advance(self, body: str) -> str:
        """The arguments text ``body`` (the block's body so far) adds since the last call."""
        start = self._pos
        while self._pos < len(body) and not self.done:
            ch = body[self._pos]
            self._pos += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                self.done = self._depth == 0
        return body[start:self._pos]
