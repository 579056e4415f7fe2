"""Tool calls through the HTTP API (and the gRPC API's replies), over a scripted target that spells a call.

The tokenizer reads text a character at a time and its chat template shows the model its tools
(tests/http/harness.py's target emits the ids the test gives it): what is checked here is the edge
and the coordinator, the parsing, streaming and the grammar sent to the target. That a real model's
calls follow the grammar through speculation is tests/integration/test_http_openai.py's.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import openai
import pytest

from tandem.tokenizer import load_tokenizer
from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.http.harness import MODEL, http_coordinator
from tests.http.test_http_api import client, post
from tests.tiny_models import save_tiny_tokenizer

VOCAB = 100  # 94 printable characters, <s>, </s>, <unk> and a few more
EOS = 1
INFO = {"vocab_size": VOCAB, "max_context": 1024}
# Shows each tool's name, then the tag that tells Tandem how calls are written; earlier calls by name and arguments.
TOOLS_TEMPLATE = ("{% if tools %}{% for tool in tools %}{{ tool.function.name }}{% endfor %}<tool_call>{% endif %}"
                  "{% for message in messages %}<s>{{ message['content'] }}{% for call in message.tool_calls or [] %}"
                  "{{ call.function.name }}{{ call.function.arguments | tojson }}{% endfor %}{% endfor %}"
                  "{% if add_generation_prompt %}#{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CALL = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'  # the tokenizer drops spaces
ASK = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = save_tiny_tokenizer(tmp_path_factory.mktemp("tool-tokenizer"), VOCAB, eos_token_id=EOS, bos_token_id=0)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(out)


def spell(tokenizer, text: str) -> list[int]:
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    assert tokenizer.decode(ids) == text  # one character a token: the scripted target writes exactly this
    return ids


def run(coro):
    return asyncio.run(coro)


def test_a_call_comes_back_parsed_out_of_the_content(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.script = [*spell(tokenizer, "Sure." + CALL), EOS]
            reply = await client(running).chat.completions.create(
                model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], max_tokens=200, temperature=0)
            choice = reply.choices[0]
            assert choice.message.content == "Sure." and choice.finish_reason == "tool_calls"
            [call] = choice.message.tool_calls
            assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == {"city": "Paris"}
            # the template showed the model both tools; nothing constrained it (auto)
            prompt = tokenizer.decode(running.target.prompts[-1])
            assert prompt.startswith("get_weatherget_time<tool_call>")
            assert not running.target.samplings[-1].grammar
    run(go())


def test_a_streamed_call_s_arguments_arrive_as_written_and_the_tags_never_reach_the_content(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.script = [*spell(tokenizer, "Sure." + CALL + CALL.replace("Paris", "Rome")), EOS]
            stream = await client(running).chat.completions.create(
                model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=200, temperature=0, stream=True)
            content, pieces, finish = "", [], None
            async for chunk in stream:
                delta = chunk.choices[0].delta
                content += delta.content or ""
                pieces += delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
            assert content == "Sure." and finish == "tool_calls"
            # As OpenAI streams a call: its first piece has its index, id, type and name; the next ones only add
            # arguments text, a character at a time here (the scripted target writes one token a step).
            firsts = [p for p in pieces if p.id]
            assert [p.index for p in firsts] == [0, 1] and len({p.id for p in firsts}) == 2
            assert all(p.type == "function" and p.function.name == "get_weather" for p in firsts)
            assert all(p.id is None and p.function.name is None for p in pieces if p not in firsts)
            arguments = ["".join(p.function.arguments for p in pieces if p.index == i) for i in (0, 1)]
            assert arguments == ['{"city":"Paris"}', '{"city":"Rome"}']  # as written, whole once joined
            assert len([p for p in pieces if p.index == 0]) == len(arguments[0])
    run(go())


def test_a_call_written_otherwise_arrives_whole_in_the_stream(tokenizer):
    """Arguments before the name: nothing is streamed until the block closes, then the call comes in one piece."""
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            call = '<tool_call>{"arguments":{"city":"Oslo"},"name":"get_weather"}</tool_call>'
            running.target.script = [*spell(tokenizer, call), EOS]
            stream = await client(running).chat.completions.create(
                model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=200, temperature=0, stream=True)
            pieces = [p async for chunk in stream for p in chunk.choices[0].delta.tool_calls or []]
            [piece] = pieces
            assert piece.index == 0 and piece.function.name == "get_weather"
            assert json.loads(piece.function.arguments) == {"city": "Oslo"}
    run(go())


def test_a_call_in_the_doubled_braces_qwen_coder_s_template_shows_is_a_call_streamed_or_not(tokenizer):
    """Qwen2.5-Coder's template prints the call format as {{"name": ..., "arguments": ...}} and the model sometimes
    copies it, bare (pydantic-ai's weather call came back as that text)."""
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            for stream in (False, True):
                running.target.script = [*spell(tokenizer, '{{"name":"get_weather","arguments":{"city":"Oslo"}}}'), EOS]
                reply = await client(running).chat.completions.create(
                    model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=200, temperature=0, stream=stream)
                if stream:
                    chunks = [chunk async for chunk in reply]
                    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                    calls = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
                    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                    names, arguments = [p.function.name for p in calls], [p.function.arguments for p in calls]
                else:
                    message, finish = reply.choices[0].message, [reply.choices[0].finish_reason]
                    content = message.content or ""
                    names = [c.function.name for c in message.tool_calls]
                    arguments = [c.function.arguments for c in message.tool_calls]
                assert (content, names, finish) == ("", ["get_weather"], ["tool_calls"]), stream
                assert [json.loads(a) for a in arguments] == [{"city": "Oslo"}]
    run(go())


def test_text_without_a_call_is_the_content_unchanged(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.script = [*spell(tokenizer, "No<tool<call>here"), EOS]  # a tag's start, not a tag
            reply = await client(running).chat.completions.create(
                model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=200, temperature=0)
            choice = reply.choices[0]
            assert choice.message.content == "No<tool<call>here" and choice.message.tool_calls is None
            assert choice.finish_reason == "stop"
    run(go())


def test_calls_that_must_be_made_go_to_the_target_as_a_grammar(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.script = [*spell(tokenizer, CALL), EOS]
            api = client(running)
            reply = await api.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK],
                                                      tool_choice="required", max_tokens=200, temperature=0)
            assert reply.choices[0].message.content is None and reply.choices[0].finish_reason == "tool_calls"
            grammar = running.target.samplings[-1].grammar
            assert grammar.startswith('start: call ("\\n"? call)* "\\n"?\n')  # blocks, then one newline may end them
            assert '"get_weather"' in grammar and '"get_time"' in grammar
            # a named function: only it; parallel_tool_calls false: one call
            await api.chat.completions.create(
                model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], max_tokens=200, temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
            grammar = running.target.samplings[-1].grammar
            assert grammar.startswith('start: call "\\n"?\n') and '"get_time"' in grammar
            assert "get_weather" not in grammar
    run(go())


def test_tool_choice_none_hides_the_tools_and_parses_nothing(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.script = [*spell(tokenizer, CALL), EOS]
            reply = await client(running).chat.completions.create(
                model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=200, temperature=0)
            assert reply.choices[0].message.content == CALL and reply.choices[0].message.tool_calls is None
            assert tokenizer.decode(running.target.prompts[-1]).startswith("<s>weather?")
    run(go())


def test_an_earlier_call_and_its_result_are_rendered_for_the_next_turn(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.script = [*spell(tokenizer, "Sunny."), EOS]
            messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
            reply = await client(running).chat.completions.create(
                model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200, temperature=0)
            assert reply.choices[0].message.content == "Sunny." and reply.choices[0].finish_reason == "stop"
            prompt = tokenizer.decode(running.target.prompts[-1])
            assert prompt.endswith('<s>weather?<s>get_weather{"city":"Paris"}<s>sunny,21C#')
    run(go())


def test_a_reply_message_goes_back_as_the_next_turn_as_the_client_sends_it(tokenizer):
    """The usual loop: the assistant message object of one reply (content null, refusal null, tool_calls) is
    appended to the conversation as the openai client serializes it."""
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.script = [*spell(tokenizer, CALL), EOS]
            api = client(running)
            first = await api.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=200,
                                                      temperature=0)
            message = first.choices[0].message
            [call] = message.tool_calls
            messages = [*ASK, message, {"role": "tool", "tool_call_id": call.id, "content": "rain"}]
            second = await api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                       max_tokens=200, temperature=0)
            assert second.choices[0].finish_reason == "tool_calls"  # the script again: what matters is the prompt
            prompt = tokenizer.decode(running.target.prompts[-1])
            assert prompt.endswith('<s>weather?<s>get_weather{"city":"Paris"}<s>rain#')
    run(go())


@pytest.mark.parametrize("change,param,words", [
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].name", "a-z"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "colour"}}}]},
     "tools[0].parameters", "schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "get_time"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response format"),
])
def test_bad_tools_are_refused_naming_them(tokenizer, change, param, words):
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            code, body = await post(running.url + "/chat/completions", {"messages": ASK, "max_tokens": 2, **change})
            assert code == 400 and body["error"]["param"] == param and words in body["error"]["message"], body
            assert not running.target.calls["Prefill"]
    run(go())


def test_a_template_that_shows_no_tools_refuses_them_and_says_what_to_do(tmp_path):
    from tests.coordinator.inprocess import tiny_tokenizer

    async def go():
        async with http_coordinator(tiny_tokenizer(tmp_path)) as running:
            code, body = await post(running.url + "/chat/completions", {"messages": ASK, "tools": [WEATHER]})
            assert code == 400 and body["error"]["param"] == "tools" and "--chat-template" in body["error"]["message"]
            code, counted = await post(running.root + "/tokenize", {"messages": ASK, "tools": [WEATHER]})
            assert code == 400 and counted["error"] == body["error"]  # /tokenize refuses what the chat would
            with pytest.raises(openai.BadRequestError):  # the client's own shape of it
                await client(running).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    run(go())


def test_tokenize_counts_a_conversation_with_its_tools_as_chat_completions_send_it(tokenizer):
    """vLLM's /tokenize takes a chat's ``tools`` (an RL trainer or a client sizing an agent's prompt counts them):
    the tokens are exactly the prompt the chat completion sent the target, for every tool choice."""
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.script = [*spell(tokenizer, "Sunny."), EOS]
            api = client(running)
            for choice in ("auto", "required", "none", {"type": "function", "function": {"name": "get_time"}}):
                code, body = await post(running.root + "/tokenize", {"messages": ASK, "tools": [WEATHER, CLOCK],
                                                                     "tool_choice": choice, "model": MODEL})
                assert code == 200, body
                await api.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK],
                                                  tool_choice=choice, max_tokens=200, temperature=0)
                assert body["tokens"] == running.target.prompts[-1], choice
                shown = tokenizer.decode(body["tokens"]).startswith("get_weatherget_time<tool_call>")
                assert shown == (choice != "none"), choice
            code, bare = await post(running.root + "/tokenize", {"messages": ASK})
            assert code == 200 and bare["count"] < body["count"]  # (body: the last choice's, tools shown)
            code, without = await post(running.root + "/tokenize", {"messages": ASK, "tools": [WEATHER],
                                                                    "tool_choice": "none"})
            assert without["tokens"] == bare["tokens"]
    run(go())


@pytest.mark.parametrize("change,param,words", [
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name", "twice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "get_time"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type", "function tools only"),
    ({"tools": [WEATHER], "messages": None, "prompt": "weather?"}, "tools", "only with messages"),
])
def test_tokenize_refuses_tools_as_chat_completions_do(tokenizer, change, param, words):
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            body = {k: v for k, v in {"messages": ASK, **change}.items() if v is not None}
            code, reply = await post(running.root + "/tokenize", body)
            assert code == 400 and reply["error"]["param"] == param and words in reply["error"]["message"], reply
    run(go())


def test_the_grpc_api_returns_the_calls_too(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.script = [*spell(tokenizer, "Ok." + CALL), EOS]
            request = generation_pb2.GenerateRequest(
                messages=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content="w")]),
                tools=generation_pb2.ToolOptions(tools=[generation_pb2.Tool(name="get_weather")]))
            request.stopping.max_new_tokens = 200
            async with grpc.aio.insecure_channel(running.grpc_address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                whole = await stub.Generate(request)
                assert whole.text == "Ok." and whole.finish_reason == "tool_calls"
                assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("get_weather",
                                                                                          {"city": "Paris"})]
                assert whole.token_ids[-1] == EOS and len(whole.token_ids) == len(spell(tokenizer, "Ok." + CALL)) + 1
                parts = [msg async for msg in stub.GenerateStream(request)]
                assert "".join(m.text for m in parts) == "Ok." and parts[-1].finish_reason == "tool_calls"
                [streamed] = [c for m in parts for c in m.tool_calls]
                deltas = [d for m in parts for d in m.tool_call_deltas]
                assert streamed.name == "get_weather" and {d.id for d in deltas} == {streamed.id}
                assert [d.name for d in deltas if d.name] == ["get_weather"]
                assert json.loads("".join(d.arguments for d in deltas)) == json.loads(streamed.arguments)
    run(go())


@pytest.mark.parametrize("choice,as_json", [(None, True), ("get_weather", True), (None, False)])
def test_tandem_generate_sends_tools_and_prints_the_calls(tokenizer, tmp_path, capsys, choice, as_json):
    from tandem.cli import main

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER, CLOCK["function"]]))  # OpenAI's items, or a function alone

    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.script = [*spell(tokenizer, "Sure." + CALL), EOS]
            flags = ["--tool-choice", choice, "--single-call"] if choice else []
            flags += ["--json"] if as_json else []
            code = await asyncio.to_thread(main, ["generate", "weather?", "--addr", running.grpc_address, "--tools",
                                                  str(tools), "--max-new-tokens", "200", *flags])
            assert code == 0
            # the prompt went as a chat turn, through the template that shows the tools
            assert tokenizer.decode(running.target.prompts[-1]).startswith("get_weatherget_time<tool_call>")
            assert bool(running.target.samplings[-1].grammar) == bool(choice)  # a named call: enforced
    run(go())
    lines = capsys.readouterr().out.strip().splitlines()
    if as_json:
        out = json.loads(lines[-1])
        assert out["text"] == "Sure." and out["finish_reason"] == "tool_calls"
        [call] = out["tool_calls"]
    else:  # the text as it streamed, then each call as one JSON object a line (after the servers' ready lines)
        assert lines[-2] == "Sure."
        call = json.loads(lines[-1])
    assert call["id"].startswith("call_") and (call["name"], call["arguments"]) == ("get_weather", {"city": "Paris"})


# ----- --chat-template ---------------------------------------------------------------------------------------

def test_chat_template_files_are_read_where_the_configuration_is_and_passed_on_by_tandem_up(tmp_path):
    from tandem.config import CoordinatorConfig, ServerOptions
    from tandem.errors import InvalidRequestError
    from tests.http.test_http_edges import up_args

    def config(path):
        return CoordinatorConfig(server=ServerOptions(port=0), tokenizer_dir="t", target_addrs=["h:1"],
                                 chat_template=path)

    good = tmp_path / "tools.jinja"
    good.write_text(TOOLS_TEMPLATE)
    assert config(good).chat_template_text() == TOOLS_TEMPLATE and config(None).chat_template_text() is None
    (tmp_path / "empty.jinja").write_text(" \n")
    (tmp_path / "binary.jinja").write_bytes(b"\xff\xfe")
    for bad, why in (("missing.jinja", "cannot read"), ("empty.jinja", "empty"), ("binary.jinja", "cannot read")):
        with pytest.raises(InvalidRequestError, match=f"--chat-template .*{bad}.*{why}"):
            config(tmp_path / bad)
    args = up_args("--chat-template", str(good))
    assert args[args.index("--chat-template") + 1] == str(good.resolve())  # absolute: the process's cwd may differ
    with pytest.raises(InvalidRequestError, match="--chat-template"):  # refused before anything starts
        up_args("--chat-template", str(tmp_path / "missing.jinja"))


def test_the_grammar_crosses_the_wire():
    from tandem.rpc.wire import sampling_from_proto, sampling_to_proto
    from tandem.sampling_params import SamplingParams

    params = SamplingParams(grammar='start: "a"')
    assert sampling_from_proto(sampling_to_proto(params)) == params and params.structured
    with pytest.raises(Exception, match="grammar"):
        SamplingParams(grammar='start: "a"', json_object=True)
