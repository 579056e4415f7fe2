"""Tool calls on real processes, through the official ``openai`` client: SmolLM2's workers (the shared cluster's)
under a coordinator of their own started with ``--chat-template examples/chat_templates/chatml_tools.jinja``
(SmolLM2's own template shows the model no tools, so the shared coordinator refuses them).

A call that must be made is a grammar the target enforces on every row it verifies: the call parses, names
the tool, has arguments under its schema, and equals constrained target-only decoding in process.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.integration.conftest import SHARED_DTYPE

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).resolve().parents[2] / "examples/chat_templates/chatml_tools.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone.", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}}, "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]
MAX_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def api(shared_cluster):
    from tests.integration.conftest import extra_coordinator

    with extra_coordinator(shared_cluster, ("--host", "127.0.0.1", "--http-port", "0",
                                            "--chat-template", str(TEMPLATE))) as coordinator:
        with openai.OpenAI(base_url=coordinator.http_url, api_key="unused", max_retries=0, timeout=120) as client:
            yield client


def constrained_target_only(model_dir: Path, tools: list[dict], choice: str, function: str = "") -> tuple[str, dict]:
    """(name, arguments) of target-only greedy decoding in process, on the prompt and grammar the coordinator
    builds (the same template, tools and choice; one call, as parallel_tool_calls false asks)."""
    from tandem.sampling_params import SamplingParams
    from tandem.tokenizer import encode_messages, load_tokenizer
    from tandem.tool_calls import HermesFormat, ToolSpec, ToolUse, parse_tool_calls
    from tests.references import target_only

    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = TEMPLATE.read_text()
    specs = tuple(ToolSpec(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
                  for t in tools)
    prompt = encode_messages(tokenizer, MESSAGES, [s.template_entry() for s in specs])
    grammar = HermesFormat.of(tokenizer).grammar(ToolUse(specs, choice, function, single_call=True))
    [ids] = target_only(model_dir, [prompt], dtype=SHARED_DTYPE, max_new_tokens=MAX_NEW_TOKENS,
                        sampling=SamplingParams(grammar=grammar)).values()
    _, [call] = parse_tool_calls(tokenizer.decode(ids, skip_special_tokens=True))
    return call.name, json.loads(call.arguments)


def test_a_required_call_follows_its_schema_and_equals_constrained_target_only(api, smollm2_dir):
    """One call (parallel_tool_calls false): left to make several, SmolLM2 repeats its call until max_tokens."""
    model = api.models.list().data[0].id
    reply = api.chat.completions.create(model=model, messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=MAX_NEW_TOKENS, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":  # under its schema: both fields, the unit one of two
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    else:
        assert call.function.name == "get_time" and set(arguments) <= {"zone"}
    assert (call.function.name, arguments) == constrained_target_only(smollm2_dir, [WEATHER, CLOCK], "required")
    assert choice.tandem["accepted"] > 0  # speculation ran: drafts were kept under the grammar
    # and what the grammar forced (the literal tags, the keys) came back from the target and was proposed and kept
    assert choice.tandem["forced_tokens"] > 0


def test_a_named_call_streams_as_written_and_joins_to_the_whole(api):
    model = api.models.list().data[0].id
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = api.chat.completions.create(model=model, messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice=named,
                                        parallel_tool_calls=False, max_tokens=MAX_NEW_TOKENS, temperature=0)
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    calls, finish = [], None
    for chunk in api.chat.completions.create(model=model, messages=MESSAGES, tools=[WEATHER, CLOCK], stream=True,
                                             tool_choice=named, parallel_tool_calls=False,
                                             max_tokens=MAX_NEW_TOKENS, temperature=0):
        if chunk.choices:
            calls += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    first, *rest = calls  # the call's first piece names it; the rest add its arguments as they are written
    assert (first.index, first.function.name) == (0, call.function.name) and first.id.startswith("call_")
    assert all(piece.index == 0 and piece.id is None and piece.function.name is None for piece in rest)
    arguments = "".join(piece.function.arguments for piece in calls)
    assert json.loads(arguments) == json.loads(call.function.arguments)
    assert finish == "tool_calls"


def test_a_tool_result_goes_back_to_the_model_for_its_answer(api, smollm2_dir):
    from tandem.tokenizer import encode_messages, load_tokenizer

    model = api.models.list().data[0].id
    call = {"id": "call_0", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": '{"sky": "sunny", "temperature": 21}'}]
    reply = api.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="none",
                                        max_tokens=MAX_NEW_TOKENS, temperature=0)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None
    # the call and its result were rendered into the prompt (tool_choice none: without the tools' list)
    tokenizer = load_tokenizer(smollm2_dir)
    tokenizer.chat_template = TEMPLATE.read_text()
    turns = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}, messages[2]]
    assert reply.usage.prompt_tokens == len(encode_messages(tokenizer, turns))
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model=model, messages=messages[:2] + [{"role": "tool", "content": "x"}],
                                    tools=[WEATHER], max_tokens=4)
    assert refused.value.body["param"] == "messages[2].tool_call_id"


def test_an_auto_call_written_as_fenced_json_is_a_call_whole_and_streamed(api, smollm2_dir):
    """Left free, Qwen2.5-Coder writes its calls as JSON in a ```json fence, not in <tool_call> blocks
    (tandem/json_tool_calls.py). SmolLM2 does too after an earlier answer written so; the call is found, whole or
    streamed, as the parser finds it in target-only's text."""
    from tandem.sampling_params import SamplingParams
    from tandem.tokenizer import encode_messages, load_tokenizer
    from tandem.tool_calls import parse_tool_calls
    from tests.references import target_only

    fenced = '```json\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n```'
    messages = [{"role": "user", "content": "What is the weather like in Rome today?"},
                {"role": "assistant", "content": fenced}, *MESSAGES]
    tokenizer = load_tokenizer(smollm2_dir)
    tokenizer.chat_template = TEMPLATE.read_text()
    [ids] = target_only(smollm2_dir, [encode_messages(tokenizer, messages, [WEATHER, CLOCK])], dtype=SHARED_DTYPE,
                        max_new_tokens=MAX_NEW_TOKENS, sampling=SamplingParams()).values()
    text = tokenizer.decode(ids, skip_special_tokens=True)
    _, [expected] = parse_tool_calls(text, frozenset({"get_weather", "get_time"}))
    assert text.startswith("```json") and expected.name == "get_weather"  # the fence, found

    model = api.models.list().data[0].id
    reply = api.chat.completions.create(model=model, messages=messages, tools=[WEATHER, CLOCK], tool_choice="auto",
                                        max_tokens=MAX_NEW_TOKENS, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (expected.name,
                                                                          json.loads(expected.arguments))
    content, calls, finish = "", [], None
    for chunk in api.chat.completions.create(model=model, messages=messages, tools=[WEATHER, CLOCK], stream=True,
                                             tool_choice="auto", max_tokens=MAX_NEW_TOKENS, temperature=0):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            calls += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    [whole] = calls  # found once its fence closed: one piece, named, with all its arguments
    assert (whole.index, whole.function.name, whole.id[:5]) == (0, "get_weather", "call_")
    assert json.loads(whole.function.arguments) == json.loads(call.function.arguments)
    assert content == "" and finish == "tool_calls"


def test_the_responses_api_gives_an_auto_call_written_as_fenced_json_as_a_function_call(api):
    """The Agents SDK's way in (POST /v1/responses, tool_choice auto): the same fenced call comes back as a
    function_call item, as the chat completion's tool call above."""
    fenced = '```json\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n```'
    turns = [{"role": "user", "content": "What is the weather like in Rome today?"},
             {"role": "assistant", "content": fenced}, *MESSAGES]
    tools = [{"type": "function", **t["function"]} for t in (WEATHER, CLOCK)]
    model = api.models.list().data[0].id
    reply = api.responses.create(model=model, input=turns, tools=tools, tool_choice="auto",
                                 max_output_tokens=MAX_NEW_TOKENS, temperature=0)
    [call] = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] == "Paris"
    assert not [item for item in reply.output if item.type == "message"]  # the fence is the call, not text
