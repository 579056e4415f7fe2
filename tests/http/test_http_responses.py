"""OpenAI's Responses API (``POST /v1/responses``) through the official ``openai`` client, over the scripted target
(tests/http/harness.py) and the tool-showing tokenizer of tests/http/test_http_tools.py: the response object, its
typed event stream, a tool call and its answer as input items, and the fields refused by name."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from tests.http.harness import LOGPROB, MODEL, http_coordinator, record_starts
from tests.http.test_http_api import client, post
from tests.http.test_http_tools import CALL, EOS, INFO, run, spell
from tests.http.test_http_tools import tokenizer as tokenizer  # noqa: F401, PLC0414 - the module's fixture

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_a_response_holds_the_text_usage_and_what_was_asked(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.script = [*spell(tokenizer, "Hello!"), EOS]
            reply = await client(running).responses.create(model=MODEL, input="hi", instructions="be brief",
                                                           max_output_tokens=50, temperature=0,
                                                           metadata={"team": "a"})
            assert reply.object == "response" and reply.id.startswith("resp_") and reply.status == "completed"
            assert reply.output_text == "Hello!" and reply.model == MODEL
            [item] = reply.output
            assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
            assert reply.usage.output_tokens == len("Hello!") + 1  # the stop token counted, as chat does
            assert reply.usage.input_tokens == len(running.target.prompts[-1])
            assert reply.instructions == "be brief" and reply.max_output_tokens == 50
            assert reply.metadata == {"team": "a"}
            # the conversation as the chat template renders it: instructions as the system turn, then the input
            chat = await client(running).chat.completions.create(
                model=MODEL, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                max_tokens=1)
            assert running.target.prompts[-1] == running.target.prompts[-2] and chat.choices
    run(go())


def test_a_response_cut_by_max_output_tokens_is_incomplete(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.script = spell(tokenizer, "abcdefgh")
            reply = await client(running).responses.create(model=MODEL, input="hi", max_output_tokens=3)
            assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
            assert reply.output_text == "abc"
    run(go())


def test_the_stream_is_typed_events_in_order_that_rebuild_the_response(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.script = [*spell(tokenizer, "Hello"), EOS]
            stream = await client(running).responses.create(model=MODEL, input="hi", max_output_tokens=50,
                                                            stream=True)
            events = [event async for event in stream]
            kinds = [e.type for e in events]
            assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                                 "response.content_part.added"]
            assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                                  "response.output_item.done", "response.completed"]
            assert [e.sequence_number for e in events] == list(range(len(events)))
            deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert deltas == "Hello" == events[-1].response.output_text
            assert events[0].response.status == "in_progress" and events[-1].response.status == "completed"
            async with aiohttp.ClientSession() as session, session.post(
                    running.url + "/responses", json={"input": "hi", "stream": True, "max_output_tokens": 2}) as raw:
                first = (await raw.read()).decode().split("\n\n")[0]
            assert first.startswith("event: response.created\ndata: {")  # OpenAI's wire: the type on its own line
    run(go())


def test_a_function_call_and_its_output_round_trip_as_items(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            api = client(running)
            running.target.script = [*spell(tokenizer, CALL), EOS]
            reply = await api.responses.create(model=MODEL, input="weather?", tools=[WEATHER], max_output_tokens=200)
            [call] = reply.output
            assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
            assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
            assert reply.output_text == ""
            # the next turn: the call and its output sent back as items, as the Agents SDK does
            running.target.script = [*spell(tokenizer, "Sunny"), EOS]
            follow = await api.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=50, input=[
                {"role": "user", "content": "weather?"},
                {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}])
            assert follow.output_text == "Sunny"
            prompt = tokenizer.decode(running.target.prompts[-1])
            assert prompt.endswith('<s>weather?<s>get_weather{"city":"Paris"}<s>{"sky":"clear"}#')
    run(go())


def test_a_streamed_call_announces_its_item_then_its_arguments(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.script = [*spell(tokenizer, "Ok." + CALL), EOS]
            stream = await client(running).responses.create(model=MODEL, input="weather?", tools=[WEATHER],
                                                            max_output_tokens=200, stream=True)
            events = [event async for event in stream]
            kinds = [e.type for e in events]
            text_done = kinds.index("response.output_item.done")
            call_added = [i for i, k in enumerate(kinds) if k == "response.output_item.added"][1]
            assert text_done < call_added  # the message item closes before the call's opens
            arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
            done = next(e for e in events if e.type == "response.function_call_arguments.done")
            assert arguments == done.arguments and json.loads(arguments) == {"city": "Paris"}
            final = events[-1].response
            assert [item.type for item in final.output] == ["message", "function_call"]
            assert final.output[0].content[0].text == "Ok." and final.output[1].name == "get_weather"
    run(go())


@pytest.mark.parametrize("fields,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "colour"}}}}, "text.format"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"n": 2}, "n"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"include": "message.output_text.logprobs"}, "include"),
    ({"top_logprobs": 21}, "top_logprobs"),
])
def test_what_tandem_cannot_honour_is_refused_naming_the_field(tokenizer, fields, param):
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            code, body = await post(running.url + "/responses", {"model": MODEL, "input": "hi", **fields})
            assert code == 400 and body["error"]["param"] == param, body
            assert not running.target.calls["Prefill"]
    run(go())


def test_a_json_schema_format_reaches_the_target(tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.script = [*spell(tokenizer, '{"n":1}'), EOS]
            reply = await client(running).responses.create(
                model=MODEL, input="count", max_output_tokens=50,
                text={"format": {"type": "json_schema", "name": "count", "schema": schema, "strict": True}})
            assert json.loads(running.target.samplings[-1].json_schema) == schema
            assert reply.text.format.type == "json_schema" and reply.output_text == '{"n":1}'
            with pytest.raises(openai.NotFoundError):
                await client(running).responses.create(model="gpt-4o", input="hi")
    run(go())


def test_a_failure_after_the_first_byte_is_an_error_event_then_response_failed(tokenizer):
    """The Verify calls hang past the request's deadline: the stream has begun, so the failure comes as events."""
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.gate.clear()
            stream = await client(running).responses.create(model=MODEL, input="hi", max_output_tokens=8, stream=True,
                                                            extra_body={"tandem": {"timeout_s": 0.3}})
            events = [event async for event in stream]
            running.target.gate.set()
            assert [e.type for e in events[-2:]] == ["error", "response.failed"]
            assert events[-2].code == "timeout" and events[-1].response.status == "failed"
            assert events[-1].response.error.code == "timeout"
    run(go())


def test_a_left_out_limit_is_what_the_context_leaves_not_the_server_default(tokenizer):
    """Agent SDKs set no limit, as OpenAI's default is the model's: so for responses and chat completions (OpenAI's
    and vLLM's default); legacy completions keep the coordinator's --max-new-tokens."""
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            limits = record_starts(running, lambda run: (len(run.state.prompt_ids), run.state.stop.max_new_tokens))
            running.target.script = [*spell(tokenizer, "ok"), EOS]
            reply = await client(running).responses.create(model=MODEL, input="hi")
            assert reply.status == "completed" and reply.output_text == "ok"
            prompt, limit = limits[-1]
            assert limit == INFO["max_context"] - prompt
            await client(running).responses.create(model=MODEL, input="hi", max_output_tokens=5)
            assert limits[-1][1] == 5
            await client(running).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            prompt, limit = limits[-1]
            assert limit == INFO["max_context"] - prompt
            await client(running).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                          max_completion_tokens=6)
            assert limits[-1][1] == 6
            await client(running).completions.create(model=MODEL, prompt="hi")
            assert limits[-1][1] == 8  # the harness coordinator's --max-new-tokens
    run(go())


def test_the_servers_limit_still_bounds_a_response_without_max_output_tokens(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, info=INFO, max_new_tokens_limit=20) as running:
            running.target.script = spell(tokenizer, "abcdefghijklmnopqrstuvwxyz")
            reply = await client(running).responses.create(model=MODEL, input="hi")
            assert reply.status == "incomplete" and reply.usage.output_tokens == 20
    run(go())


def test_logprobs_come_with_the_output_text_whole_and_streamed(tokenizer):
    """``include: ["message.output_text.logprobs"]``: each token of the text with its score and ``top_logprobs``
    alternatives (the stop token's too, as chat completions count it), the deltas' scores adding up to the done
    event's; ``top_logprobs`` alone asks none (as OpenAI's)."""
    include = ["message.output_text.logprobs"]

    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            api = client(running)
            running.target.script = [*spell(tokenizer, "Hello"), EOS]
            reply = await api.responses.create(model=MODEL, input="hi", max_output_tokens=50, include=include,
                                               top_logprobs=2)
            assert running.target.samplings[-1].logprobs == 2
            part = reply.output[0].content[0]
            assert part.text == "Hello" and len(part.logprobs) == len("Hello") + 1
            assert "".join(lp.token for lp in part.logprobs) == tokenizer.decode([*spell(tokenizer, "Hello"), EOS])
            assert all(lp.logprob == LOGPROB and len(lp.top_logprobs) == 2 for lp in part.logprobs)
            assert [lp.top_logprobs[0].token for lp in part.logprobs] == [lp.token for lp in part.logprobs]
            assert part.logprobs[0].bytes == list(b"H") and reply.top_logprobs == 2

            stream = await api.responses.create(model=MODEL, input="hi", max_output_tokens=50, include=include,
                                                stream=True)
            events = [event async for event in stream]
            deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
            [done] = [e for e in events if e.type == "response.output_text.done"]
            final = events[-1].response.output[0].content[0].logprobs
            assert [d.token for d in deltas] == [d.token for d in done.logprobs][:len(deltas)]
            assert len(done.logprobs) == len(final) == len(part.logprobs) and len(deltas) >= len("Hello")
            assert all(lp.top_logprobs == [] for lp in final)  # top_logprobs left out: 0 alternatives

            plain = await api.responses.create(model=MODEL, input="hi", max_output_tokens=50, top_logprobs=2)
            assert plain.output[0].content[0].logprobs == [] and not running.target.samplings[-1].HasField("logprobs")
    run(go())


def test_a_calls_tokens_are_not_scored_as_text(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, info=INFO) as running:
            running.target.script = [*spell(tokenizer, "Ok." + CALL), EOS]
            reply = await client(running).responses.create(
                model=MODEL, input="weather?", tools=[WEATHER], max_output_tokens=200,
                include=["message.output_text.logprobs"])
            message, call = reply.output
            assert call.type == "function_call" and message.content[0].text == "Ok."
            assert [lp.token for lp in message.content[0].logprobs] == ["O", "k", "."]
    run(go())
