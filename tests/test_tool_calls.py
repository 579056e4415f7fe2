"""Tool calls: the rules of a request's tools, the streamed parser, the grammar of calls that must be made (through
llguidance on a real tokenizer), and which chat templates show tools."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.errors import InvalidRequestError
from tandem.tool_calls import HermesFormat, ToolCallParser, ToolSpec, ToolUse, parse_call, parse_tool_calls

WEATHER = ToolSpec("get_weather", "the weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                                  "required": ["city"], "additionalProperties": False})
CLOCK = ToolSpec("get_time")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = (
    "Let me look.\n" + CALL,
    CALL + "\n" + CALL.replace("Paris", "Rome"),
    "plain text  \n with spaces and a < sign \n",
    "a <tool_call> not json </tool_call> b",
    "cut short <tool_call>\n" + '{"name": "get_time", "arguments": {}}',  # unclosed, but whole JSON
    "cut short <tool_call>\n{\"name\": \"get_ti",  # unclosed and incomplete: text
    CALL + "\nDone.",
    "<tool_cal",
    '<tool_call>\n{{"name": "get_weather", "arguments": {"city": "Oslo"}}}\n</tool_call>',  # as Qwen2.5-Coder's
)                                                                                 # template shows the format
ROOT = Path(__file__).resolve().parents[1]


def summary(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_in_any_pieces_the_parser_gives_what_the_whole_text_gives(text):
    content, calls = parse_tool_calls(text)
    for size in range(1, len(text) + 1):
        parser = ToolCallParser()
        streamed, got = "", []
        for start in range(0, len(text), size):
            piece, more = parser.feed(text[start:start + size], final=start + size >= len(text))
            streamed += piece
            got += more
        assert (streamed, summary(got)) == (content, summary(calls)), size


NESTED = ('<tool_call>\n{"name": "search", "arguments": {"q": "a } and a \\" and {", "filters": [{"k": [1, {}]}], '
          '"n": 3}}\n</tool_call>')


@pytest.mark.parametrize("text", [*TEXTS, NESTED])
def test_arguments_stream_as_written_in_any_pieces_and_join_to_the_call(text):
    """Each call's deltas: the first names it, all share the call's id, and the arguments text they add, joined,
    is the arguments object as written (nothing of the wrapper after it), whatever the pieces."""
    _, calls = parse_tool_calls(text)
    for size in range(1, len(text) + 1):
        parser, got, deltas = ToolCallParser(), [], []
        for start in range(0, len(text), size):
            got += parser.feed(text[start:start + size], final=start + size >= len(text))[1]
            deltas += parser.take_deltas()
        assert summary(got) == summary(calls)
        for call in got:
            mine = [d for d in deltas if d.id == call.id]
            assert [d.name for d in mine if d.name] == [call.name] and mine[0].name == call.name
            arguments = "".join(d.arguments for d in mine)
            assert json.loads(arguments) == json.loads(call.arguments) and arguments.endswith("}"), size
        assert {d.id for d in deltas} == {c.id for c in got}, size  # no delta of a block that is no call


def test_a_call_streams_before_its_block_closes_and_one_written_otherwise_does_not():
    parser = ToolCallParser()
    parser.feed('Sure <tool_call>\n{"name": "get_weather", "arguments": {"ci')
    [first] = parser.take_deltas()
    assert (first.name, first.arguments) == ("get_weather", '{"ci')
    parser.feed('ty": "Paris"}}\n</tool_')
    assert [d.arguments for d in parser.take_deltas()] == ['ty": "Paris"}']  # not the wrapper's brace
    assert parser.feed("call>", final=True)[1][0].id == first.id
    # arguments first, or as a string: nothing streams; the call comes whole when its block closes
    for body in ('{"arguments": {"city": "Rome"}, "name": "get_weather"}',
                 '{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}'):
        parser = ToolCallParser()
        _, calls = parser.feed(f"<tool_call>{body}</tool_call>", final=True)
        assert summary(calls) == [("get_weather", {"city": "Rome"})] and parser.take_deltas() == []


def test_a_block_that_opens_as_a_call_and_breaks_has_streamed_and_becomes_content():
    """Unconstrained (auto), a model may open a call and never close its JSON: what streamed stays streamed (OpenAI's
    protocol cannot take it back) and the block is content, as every block that is no call."""
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call>'
    parser = ToolCallParser()
    content, calls = parser.feed(text, final=True)
    assert (content, calls) == (text, [])
    assert [(d.name, d.arguments) for d in parser.take_deltas()] == [("get_weather", '{"city": "Par')]


def test_what_is_content_and_what_is_a_call():
    assert parse_tool_calls(TEXTS[0])[0] == "Let me look." and summary(parse_tool_calls(TEXTS[0])[1]) == [
        ("get_weather", {"city": "Paris"})]
    content, calls = parse_tool_calls(TEXTS[1])
    assert content == "" and [c["city"] for _, c in summary(calls)] == ["Paris", "Rome"]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert parse_tool_calls(TEXTS[2]) == (TEXTS[2], [])  # no call: the text exactly, whitespace included
    assert parse_tool_calls(TEXTS[3]) == (TEXTS[3], [])  # a block that is no call stays as written
    assert summary(parse_tool_calls(TEXTS[4])[1]) == [("get_time", {})]
    assert parse_tool_calls(TEXTS[5]) == (TEXTS[5], [])
    assert parse_tool_calls(TEXTS[6])[0] == "Done."
    assert parse_tool_calls(TEXTS[7]) == ("<tool_cal", [])
    assert parse_tool_calls(TEXTS[8])[0] == "" and summary(parse_tool_calls(TEXTS[8])[1]) == [
        ("get_weather", {"city": "Oslo"})]


def test_a_block_is_a_call_only_with_a_name_and_object_arguments():
    assert parse_call('{"name": "f", "arguments": {"a": 1}}') == ("f", '{"a": 1}')
    assert parse_call('{"name": "f", "parameters": {"a": 1}}') == ("f", '{"a": 1}')  # another Hermes spelling
    assert parse_call('{"name": "f", "arguments": "{\\"a\\": 1}"}') == ("f", '{"a": 1}')  # arguments as text
    assert parse_call('{"name": "f"}') == ("f", "{}")
    assert parse_call('{{"name": "f", "arguments": {"a": 1}}}') == ("f", '{"a": 1}')  # the template's braces
    for body in ('{"arguments": {}}', '{"name": "", "arguments": {}}', '{"name": "f", "arguments": [1]}',
                 '{"name": "f", "arguments": "not json"}', "[1]", "{", "{{}}", '{{"name": "f"}, {"name": "g"}}'):
        assert parse_call(body) is None, body


@pytest.mark.parametrize("tools,choice,function,words", [
    ((ToolSpec("a b"),), "auto", "", "a-z"),
    ((ToolSpec("x" * 65),), "auto", "", "a-z"),
    ((CLOCK, CLOCK), "auto", "", "twice"),
    ((ToolSpec("f", parameters=[1]),), "auto", "", "JSON schema"),
    ((CLOCK,), "sometimes", "", "one of"),
    ((), "required", "", "needs tools"),
    ((CLOCK,), "function", "get_weather", "no tool is named"),
    ((CLOCK,), "auto", "get_time", "only with choice"),
    (tuple(ToolSpec(f"f{i}") for i in range(129)), "auto", "", "at most 128"),
])
def test_bad_tools_are_refused_naming_why(tools, choice, function, words):
    with pytest.raises(InvalidRequestError, match=words):
        ToolUse(tools, choice, function)


class _ByteTokens:
    """A byte-level vocabulary for llguidance: ids 0-255 are the bytes, 256 the stop token."""

    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([b]) for b in range(256)] + [b"</s>"]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


@pytest.fixture(scope="module")
def matcher_of():
    """A matcher factory for a grammar, on a byte-level tokenizer (every text is spellable, newlines included)."""
    import llguidance

    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()))

    def accepts(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        ids = list(text.encode())
        # the whole text, and then the grammar may end (the stop token is allowed)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    return accepts


def test_the_grammar_takes_calls_to_the_tools_under_their_schemas_and_nothing_else(matcher_of):
    fmt = HermesFormat(special_tags=False)
    required = fmt.grammar(ToolUse((WEATHER, CLOCK), "required"))
    call = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
    clock = '<tool_call>{"name":"get_time","arguments":{}}</tool_call>'
    assert matcher_of(required, call) and matcher_of(required, clock) and matcher_of(required, call + clock)
    for wrong in ('<tool_call>{"name":"get_wether","arguments":{"city":"Paris"}}</tool_call>',  # no such tool
                  '<tool_call>{"name":"get_weather","arguments":{"town":"Paris"}}</tool_call>',  # not its schema
                  '<tool_call>{"name":"get_weather","arguments":{}}</tool_call>',  # city is required
                  "Sure" + call,  # no text before the calls
                  ""):  # and at least one
        assert not matcher_of(required, wrong), wrong
    named = fmt.grammar(ToolUse((WEATHER, CLOCK), "function", "get_time", single_call=True))
    assert matcher_of(named, clock) and not matcher_of(named, call) and not matcher_of(named, clock + clock)


def test_the_grammar_may_end_after_the_newline_that_follows_a_block(matcher_of):
    """Templates end a block with a newline before the stop token, and a model writes it: if that newline could only
    open another block, the model was made to write its call again, and again, until max_tokens."""
    fmt = HermesFormat(special_tags=False)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    clock = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    required = fmt.grammar(ToolUse((WEATHER, CLOCK), "required"))
    single = fmt.grammar(ToolUse((WEATHER, CLOCK), "required", single_call=True))
    for grammar in (required, single):
        assert matcher_of(grammar, call + "\n")  # and the stop token may follow
        assert not matcher_of(grammar, call + "\n\n") and not matcher_of(grammar, call + "\nDone.")
    assert matcher_of(required, call + "\n" + clock + "\n") and not matcher_of(single, call + "\n" + clock)


def test_special_tags_are_named_as_tokens_in_the_grammar():
    grammar = HermesFormat(special_tags=True).grammar(ToolUse((CLOCK,), "required"))
    assert "call: <tool_call> " in grammar and " </tool_call>\n" in grammar


def test_which_templates_show_tools(tmp_path):
    from tandem.tokenizer import load_tokenizer
    from tests.tiny_models import save_tiny_tokenizer

    tokenizer = load_tokenizer(save_tiny_tokenizer(tmp_path, 100, eos_token_id=1, bos_token_id=0, chat=True))
    assert HermesFormat.of(tokenizer) is None  # a chat template with no tools
    tokenizer.chat_template = "<tool_call>{% for m in messages %}{{ m.content }}{% endfor %}"  # the tag, no tools
    assert HermesFormat.of(tokenizer) is None
    tokenizer.chat_template = (ROOT / "examples/chat_templates/chatml_tools.jinja").read_text()
    fmt = HermesFormat.of(tokenizer)
    assert fmt is not None and not fmt.special_tags  # the tags are plain text to this tokenizer


def test_the_chatml_tools_template_shows_tools_calls_and_results(tmp_path):
    """As transformers renders it (the coordinator's way)."""
    from tandem.tokenizer import load_tokenizer
    from tandem.tool_calls import ToolCall
    from tests.tiny_models import save_tiny_tokenizer

    tokenizer = load_tokenizer(save_tiny_tokenizer(tmp_path, 100, eos_token_id=1, bos_token_id=0))
    tokenizer.chat_template = (ROOT / "examples/chat_templates/chatml_tools.jinja").read_text()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    ToolCall("c1", "get_weather", '{"city": "Paris"}').template_entry()]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER.template_entry()], add_generation_prompt=True,
                                         tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER.template_entry()) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n") in text
    assert text.count("Be brief.") == 1
