"""Calls written as plain JSON (tandem/json_tool_calls.py): which texts are calls, that any split of a text into
pieces gives what the whole gives, and that what cannot become a call streams without waiting."""

from __future__ import annotations

import json

import pytest

from tandem.json_tool_calls import JsonCallFinder, calls_in
from tandem.tool_calls import ToolCallParser, parse_tool_calls

NAMES = frozenset({"get_weather", "get_time"})
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
PARIS = ("get_weather", {"city": "Paris"})
ROME = ("get_weather", {"city": "Rome"})
# (text, its content, its calls)
CASES = [
    ("```json\n" + CALL + "\n```", "", [PARIS]),  # Qwen2.5-Coder's way
    ("```\n" + CALL + "\n```\n", "", [PARIS]),
    ("Let me look.\n\n```json\n" + CALL + "\n```\n\nDone.", "Let me look.Done.", [PARIS]),  # as Hermes blocks
    (CALL, "", [PARIS]),
    ("  " + CALL + "\nThat asks for the weather.", "That asks for the weather.", [PARIS]),
    ("[" + CALL + ", " + CALL.replace("Paris", "Rome") + "]", "", [PARIS, ROME]),
    ("```json\n" + CALL + "\n```\n```json\n" + CALL.replace("Paris", "Rome") + "\n```", "", [PARIS, ROME]),
    ('{"name": "get_time", "parameters": "{}"}', "", [("get_time", {})]),  # Hermes' key; arguments as text
    ("```json\n" + CALL, "", [PARIS]),  # cut short after whole JSON (max_tokens)
    ("{" + CALL + "}", "", [PARIS]),  # braces doubled, as Qwen2.5-Coder's template shows the format
    ("```json\n{" + CALL + "}\n```", "", [PARIS]),
    ("{" + CALL + "}\nThat asks for the weather.", "That asks for the weather.", [PARIS]),
    # not calls: content exactly as written
    ("```json\n" + '{"name": "get_weather", "arguments": {"city": "Pa', None, []),  # cut short inside the JSON
    ('```json\n{"name": "send_mail", "arguments": {}}\n```', None, []),  # a tool the request did not offer
    ('```json\n{"name": "get_weather", "arguments": {}, "id": 3}\n```', None, []),  # more than a call
    ('```json\n{"name": "get_time", "arguments": [1]}\n```', None, []),
    ('```json\n[]\n```', None, []),
    ("```python\nprint('hi')\n```\nand\n```json\n{\"a\": 1}\n```", None, []),
    ("Call it as `" + CALL + "` inline.", None, []),  # neither fenced nor the answer
    ("text ``` inline ``` text", None, []),
    ("{x} is a set", None, []),
    ('{{"name": "send_mail", "arguments": {}}}', None, []),  # doubled braces around a call to no offered tool
    ('{{"a": 1}}', None, []),
    ("{{" + CALL + "}}", None, []),  # braces doubled twice: not the format shown
    ("a\n```\nplain\n```\n", None, []),
    ("```json\n```\n", None, []),
    ("plain text  \n with spaces \n", None, []),
    ("", None, []),
]


def pieces(text: str, size: int):
    for start in range(0, max(1, len(text)), size):
        yield text[start:start + size], start + size >= len(text)


def summary(found) -> list[tuple[str, dict]]:
    return [(name, json.loads(arguments)) for name, arguments in found]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_each_text_gives_its_content_and_calls_in_any_pieces(text, content, calls):
    expected = (text if content is None else content, calls)
    for size in range(1, len(text) + 2):
        finder, streamed, found = JsonCallFinder(NAMES), "", []
        for piece, final in pieces(text, size):
            out, more = finder.feed(piece, final)
            streamed += out
            found += more
        assert (streamed, summary(found)) == expected, size
        assert finder.found == len(calls)


def test_only_a_call_shaped_value_naming_an_offered_tool_is_a_call():
    assert calls_in({"name": "get_time"}, NAMES) == [("get_time", "{}")]
    assert calls_in({"name": "get_time", "arguments": {}, "parameters": {}}, NAMES) is None  # which one?
    assert calls_in({"name": "get_time", "arguments": "[1]"}, NAMES) is None
    assert calls_in([{"name": "get_time"}, {"name": "nope"}], NAMES) is None  # every one, or none
    assert calls_in("get_time", NAMES) is None and calls_in([], NAMES) is None


def test_what_cannot_become_a_call_streams_before_its_fence_closes():
    finder = JsonCallFinder(NAMES)
    assert finder.feed("Here:\n```python\nprint(1)\n") == ("Here:\n```python\nprint(1)", [])
    assert finder.feed("x = 2\n`")[0] == "\nx = 2"  # a line break and backtick that may close it are held
    assert finder.feed("``\nDone.", final=True) == ("\n```\nDone.", [])
    finder = JsonCallFinder(NAMES)  # a JSON fence streams from its first character that is not { or [
    assert finder.feed("```json\n  \n") == ("", [])
    assert finder.feed("null\n") == ("```json\n  \nnull\n", [])
    finder = JsonCallFinder(NAMES)  # a fence held while it may hold a call; the whitespace before it too
    assert finder.feed("Look:\n\n```json\n{") == ("Look:", [])


def test_the_parser_finds_plain_json_calls_only_given_the_tools_names():
    text = "Sure.\n```json\n" + CALL + "\n```"
    assert parse_tool_calls(text) == (text, [])  # enforced choices (a grammar writes blocks) and no tools
    content, [call] = parse_tool_calls(text, NAMES)
    assert content == "Sure." and (call.name, json.loads(call.arguments)) == PARIS and call.id.startswith("call_")
    parser = ToolCallParser(NAMES)  # beside Hermes blocks, in one stream: both kinds, in order
    block = "<tool_call>\n" + CALL.replace("Paris", "Rome") + "\n</tool_call>\n"
    content, calls = parser.feed(block + text, final=True)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [ROME, PARIS]
    assert parser.calls == calls
