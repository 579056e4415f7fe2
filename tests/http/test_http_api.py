"""The OpenAI-compatible HTTP API over a scripted target (tests/http/harness.py): shapes, the wire, the guards.

The official ``openai`` client where it applies (it parses what OpenAI sends), raw HTTP where the bytes
matter. Everything runs in one event loop: the coordinator, its HTTP server and the clients.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import grpc
import openai
import pytest

from coordinator.http.responses import tandem_stats
from tandem.spec.adaptive import IN_FLIGHT_TOKENS
from tandem.spec.failover import ROOM_HOLD_S
from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.coordinator.inprocess import tiny_tokenizer
from tests.http.harness import LOGPROB, MODEL, TOKENS, http_coordinator

TEXT = "&(*,"  # TOKENS as the tiny tokenizer spells them: one character each
TOKEN = "tok-a-0123456789abcdef"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def run(coro):
    return asyncio.run(coro)


def client(running, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=running.url, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


async def post(url: str, body, headers=None, raw: bool = False) -> tuple[int, dict]:
    data = body if raw else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session, session.post(url, data=data, headers=headers) as reply:
        return reply.status, await reply.json(content_type=None)


# ----- completions, whole and streamed -------------------------------------------------------------------------

def test_chat_completion_through_the_openai_client(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            reply = await client(running).chat.completions.create(
                model=MODEL, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                max_tokens=4, temperature=0)
            choice = reply.choices[0]
            assert choice.message.content == TEXT and choice.message.role == "assistant"
            assert choice.finish_reason == "length" and reply.model == MODEL and reply.object == "chat.completion"
            # the whole conversation went through the chat template: system turn, user turn, generation prompt
            prompt = list(tokenizer.apply_chat_template(
                [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                add_generation_prompt=True, tokenize=True)["input_ids"])
            assert running.target.prompts[-1] == prompt
            # the most its KV may reach: prompt, answer and a round in flight (the room the target keeps it)
            assert running.target.max_lens[-1] == len(prompt) + 4 + IN_FLIGHT_TOKENS
            usage = reply.usage
            assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(prompt), 4,
                                                                                          len(prompt) + 4)
            stats = choice.model_extra["tandem"]  # the extension field, per choice
            assert stats["generated_tokens"] == 4 and stats["rounds"] == 3 and "acceptance" in stats
            for _ in range(200):  # released after the reply (coordinator/service.py, _release_later)
                if not running.target.live:
                    break
                await asyncio.sleep(0.01)
            assert not running.target.live  # every sequence released
    run(go())


def test_acceptance_is_null_when_nothing_was_drafted():
    """A ``none`` request drafts nothing: its acceptance is unknown, not 0.0 (a draft that was always wrong)."""
    plain = tandem_stats(generation_pb2.GenerationStats(generated_tokens=5, rounds=5, method="none"))
    assert plain["acceptance"] is None and plain["drafted"] == 0
    drafted = tandem_stats(generation_pb2.GenerationStats(drafted=4, accepted=1, acceptance_rate=0.25))
    assert drafted["acceptance"] == 0.25
    rejected = tandem_stats(generation_pb2.GenerationStats(drafted=4, accepted=0, acceptance_rate=0.0))
    assert rejected["acceptance"] == 0.0


def test_usage_counts_the_prompt_tokens_the_target_found_cached(tokenizer):
    """OpenAI's ``usage.prompt_tokens_details.cached_tokens``: what the target's prefix cache served of the
    prompt (the scripted target answers as a cache of 16-token blocks would)."""
    async def go():
        async with http_coordinator(tokenizer) as running:
            api = client(running)
            messages = [{"role": "system", "content": "answer as a ship's log"},
                        {"role": "user", "content": "hi"}]
            cold = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
            warm = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
            prompt = cold.usage.prompt_tokens
            assert cold.usage.prompt_tokens_details.cached_tokens == 0
            assert warm.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // 16 * 16 > 0
            assert warm.usage.prompt_tokens_details.cached_tokens == warm.choices[0].model_extra["tandem"][
                "prompt_tokens_reused"]
            chunks = [c async for c in await api.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=2, temperature=0, stream=True,
                stream_options={"include_usage": True})]
            assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (prompt - 1) // 16 * 16
    run(go())


def test_completions_take_text_token_ids_and_a_list_of_one(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            api = client(running)
            for prompt in ("hello", [5, 6, 7], ["hello"], [[5, 6, 7]]):
                reply = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
                assert reply.choices[0].text == TEXT[:3] and reply.object == "text_completion"
            assert running.target.prompts[-1] == [5, 6, 7] and running.target.prompts[0] == tokenizer.encode("hello")
    run(go())


def test_streamed_chat_reassembles_and_ends_with_usage(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            stream = await client(running).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
                stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEXT
            ends = [c for c in chunks if c.choices and c.choices[0].finish_reason]
            assert len(ends) == 1 and ends[0].choices[0].finish_reason == "length"
            assert ends[0].choices[0].model_extra["tandem"]["generated_tokens"] == 4
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
            assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1
    run(go())


def test_sse_wire_format_line_by_line(tokenizer):
    """The bytes: each event one ``data: <json>`` line and a blank line; [DONE] last; OpenAI's chunk fields."""
    async def go():
        async with http_coordinator(tokenizer) as running:
            async with aiohttp.ClientSession() as session, session.post(
                    running.url + "/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}) as reply:
                assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/event-stream")
                raw = (await reply.read()).decode()
        assert raw.endswith("data: [DONE]\n\n")
        events = raw.split("\n\n")
        assert events[-1] == "" and events[-2] == "data: [DONE]"
        chunks = []
        for event in events[:-2]:
            assert event.startswith("data: ") and "\n" not in event, event
            chunks.append(json.loads(event[len("data: "):]))
        text = ""
        for chunk in chunks:
            assert set(chunk) == {"id", "object", "created", "model", "system_fingerprint", "choices"}
            assert chunk["object"] == "text_completion" and chunk["id"].startswith("cmpl-")
            [choice] = chunk["choices"]
            text += choice["text"]
        assert text == TEXT and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    run(go())


def test_n_choices_are_indexed_and_counted(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            api = client(running)
            reply = await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=3, n=3)
            assert [c.index for c in reply.choices] == [0, 1, 2]
            assert all(c.message.content == TEXT[:3] for c in reply.choices)
            assert reply.usage.completion_tokens == 9 and running.target.calls["Prefill"] == 3
            stream = await api.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2, stream=True)
            texts = {0: "", 1: ""}
            async for chunk in stream:
                for c in chunk.choices:
                    texts[c.index] += c.text
            assert texts == {0: TEXT[:2], 1: TEXT[:2]}
    run(go())


def test_logprobs_in_each_endpoints_format(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            api = client(running)
            reply = await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=3, logprobs=True, top_logprobs=2)
            content = reply.choices[0].logprobs.content
            assert [c.token for c in content] == list(TEXT[:3]) and all(c.logprob == LOGPROB for c in content)
            assert [t.token for t in content[0].top_logprobs] == ["&", '"'] and content[0].bytes == [ord("&")]
            reply = await api.completions.create(model=MODEL, prompt="hi", max_tokens=3, logprobs=1)
            lp = reply.choices[0].logprobs
            assert lp.tokens == list(TEXT[:3]) and lp.token_logprobs == [LOGPROB] * 3
            assert lp.top_logprobs == [{"&": LOGPROB}, {"(": LOGPROB}, {"*": LOGPROB}] and lp.text_offset == [0, 1, 2]
            stream = await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=3, logprobs=True, stream=True)
            streamed = [t.token async for chunk in stream for c in chunk.choices if c.logprobs
                        for t in c.logprobs.content]
            assert streamed == list(TEXT[:3])
            plain = await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=2)
            assert plain.choices[0].logprobs is None
    run(go())


def test_the_request_id_is_the_clients_or_made_and_echoed(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running, aiohttp.ClientSession() as session:
            async with session.post(running.url + "/completions", json={"prompt": "hi", "max_tokens": 1},
                                    headers={"X-Request-Id": "req-42"}) as reply:
                assert reply.headers["X-Request-Id"] == "req-42" and (await reply.json())["id"] == "cmpl-req-42"
            async with session.post(running.url + "/chat/completions", json={**CHAT, "stream": True}) as reply:
                made = reply.headers["X-Request-Id"]
                assert len(made) == 16 and f'"id":"chatcmpl-{made}"' in (await reply.text())
            code, body = await post(running.url + "/completions", {"prompt": "hi"}, headers={"X-Request-Id": "a\tb"})
            assert code == 400 and body["error"]["param"] == "x-request-id"  # the service's rule: printable
    run(go())


def test_models_and_health(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            models = await client(running).models.list()
            assert [m.id for m in models.data] == [MODEL] and models.data[0].model_extra["max_model_len"] == 64
            async with aiohttp.ClientSession() as session:
                async with session.get(running.root + "/health") as reply:
                    assert reply.status == 200
                async with session.get(running.url + "/models/" + MODEL) as reply:
                    assert reply.status == 200 and (await reply.json())["id"] == MODEL
    run(go())


def test_metrics_and_version_are_served_on_the_api_port_without_a_token(tokenizer):
    """vLLM serves Prometheus metrics and its version on the API port: a scrape set up for it finds the
    coordinator's own metrics there (the ones its metrics port serves), counting the requests served."""
    from tandem import __version__

    async def go():
        async with http_coordinator(tokenizer, tokens=(TOKEN,)) as running:
            await client(running, api_key=TOKEN).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0)
            async with aiohttp.ClientSession() as session:  # no token: a scraper holds none
                async with session.get(running.root + "/metrics") as reply:
                    assert reply.status == 200 and reply.content_type == "text/plain"
                    text = await reply.text()
                async with session.get(running.root + "/version") as reply:
                    assert reply.status == 200 and await reply.json() == {"version": __version__}
            assert 'tandem_coordinator_requests_total{outcome="ok"} 1.0' in text, text[:2000]
            assert "tandem_coordinator_generated_tokens_total 2.0" in text
            assert "tandem_coordinator_room_waits_total 0.0" in text
            # a prompt refused for a full pool waits and asks again: a room wait, not a preemption (it held nothing)
            running.target.full_prefills = 2
            reply = await client(running, api_key=TOKEN).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0)
            assert reply.choices[0].model_extra["tandem"]["preemptions"] == 0
            async with aiohttp.ClientSession() as session, session.get(running.root + "/metrics") as metrics:
                text = await metrics.text()
            assert "tandem_coordinator_room_waits_total 2.0" in text
            assert "tandem_coordinator_preemptions_total 0.0" in text
    run(go())


def test_messages_reach_grpc_too(tokenizer):
    """The gRPC API takes a conversation (ChatMessages) through the same template."""
    from tandem.rpc.tls import open_channel

    async def go():
        async with http_coordinator(tokenizer) as running:
            async with open_channel(running.grpc_address, None, aio=True) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                request = generation_pb2.GenerateRequest(stopping=generation_pb2.StoppingOptions(max_new_tokens=2))
                request.messages.messages.add(role="system", content="a")
                request.messages.messages.add(role="user", content="b")
                reply = await stub.Generate(request)
                assert reply.text == TEXT[:2] and running.target.prompts[-1] == [0, 39, 0, 39, 4]
    run(go())


def test_continue_final_message_continues_the_assistants_prefill(tokenizer):
    """vLLM's ``continue_final_message``: the prompt ends inside the last (assistant) turn, as the template renders
    it open, and the reply holds only what follows it; gRPC's ``ChatMessages.continue_final_message`` alike."""
    from tandem.rpc.tls import open_channel

    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ab"}]
    open_turn = list(tokenizer.apply_chat_template(turns, continue_final_message=True, tokenize=True)["input_ids"])
    new_turn = list(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert len(open_turn) < len(new_turn)  # no end of turn, no new assistant turn

    async def go():
        async with http_coordinator(tokenizer) as running:
            api = client(running)
            for extra in ({"continue_final_message": True},
                          {"continue_final_message": True, "add_generation_prompt": False}):
                reply = await api.chat.completions.create(model=MODEL, messages=turns, max_tokens=3, temperature=0,
                                                          extra_body=extra)
                assert running.target.prompts[-1] == open_turn
                assert reply.choices[0].message.content == TEXT[:3]  # the continuation alone, not "ab" again
                assert reply.usage.prompt_tokens == len(open_turn)
            await api.chat.completions.create(model=MODEL, messages=turns, max_tokens=3, temperature=0)
            assert running.target.prompts[-1] == new_turn  # left out: a new assistant turn, as before
            async with open_channel(running.grpc_address, None, aio=True) as channel:
                request = generation_pb2.GenerateRequest(stopping=generation_pb2.StoppingOptions(max_new_tokens=2))
                request.messages.messages.add(role="user", content="hi")
                request.messages.messages.add(role="assistant", content="ab")
                request.messages.continue_final_message = True
                reply = await generation_pb2_grpc.GenerationStub(channel).Generate(request)
                assert reply.text == TEXT[:2] and running.target.prompts[-1] == open_turn
    run(go())


# ----- refusals ----------------------------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("change,param,status", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", 400),
    ({"response_format": {"type": "yaml"}}, "response_format.type", 400),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", 400),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "color"}}}}, "response_format",
     400),  # the service's check: a schema no grammar can hold, refused before any worker
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema", 400),
    ({"presence_penalty": 2.5}, "presence_penalty", 400),  # the service's range, named as this field
    ({"frequency_penalty": -3}, "frequency_penalty", 400),
    ({"frequency_penalty": "high"}, "frequency_penalty", 400),
    ({"repetition_penalty": 0}, "repetition_penalty", 400),
    ({"repetition_penalty": -1.2}, "repetition_penalty", 400),
    ({"logit_bias": {"5": 101}}, "logit_bias", 400),
    ({"logit_bias": {"five": 1}}, "logit_bias", 400),
    ({"logit_bias": {"5": "up"}}, "logit_bias", 400),
    ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias", 400),
    ({"logit_bias": {"99999": 1}}, "logit_bias", 400),  # past the model's vocabulary
    ({"logit_bias": [5, 10]}, "logit_bias", 400),
    ({"frobnicate": 1}, "frobnicate", 400),
    ({"n": 0}, "n", 400),
    ({"n": 17}, "n", 400),
    ({"temperature": "hot"}, "temperature", 400),
    ({"temperature": -1}, "temperature", 400),  # the service's own check, named as this field
    ({"top_p": 0}, "top_p", 400),
    ({"max_tokens": -1}, "max_tokens", 400),
    ({"max_tokens": 100}, "max_tokens", 400),  # the context (64) is the service's to check
    ({"max_completion_tokens": 100, "max_tokens": None}, "max_completion_tokens", 400),
    ({"stop": [chr(ord("a") + i) for i in range(17)]}, "stop", 400),
    ({"stop": ""}, "stop", 400),
    ({"messages": []}, "messages", 400),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", 400),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", 400),
    ({"tools": {"f": {}}}, "tools", 400),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", 400),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name", 400),
    ({"tool_choice": "maybe"}, "tool_choice", 400),
    ({"tool_choice": "required"}, "tool_choice", 400),  # the service's rule: nothing to call
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", 400),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", 400),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].arguments", 400),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls",
     400),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type", 400),
    ({"messages": [{"role": "user", "content": "x", "mood": "happy"}]}, "messages[0].mood", 400),
    ({"top_logprobs": 2}, "top_logprobs", 400),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", 400),
    ({"stream_options": {"include_usage": True}}, "stream_options", 400),
    ({"tandem": {"k": 99}}, "tandem.k", 400),
    ({"tandem": {"heads_nodes": 99}}, "tandem.heads_nodes", 400),
    ({"tandem": {"method": "medusa"}}, "tandem.method", 400),
    ({"tandem": {"warp": 9}}, "tandem.warp", 400),
    ({"seed": 2**64}, "seed", 400),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message", 400),
    ({"add_generation_prompt": False}, "add_generation_prompt", 400),
    ({"continue_final_message": True}, "messages", 400),  # the service's rule: the last turn is a user's
    ({"continue_final_message": True, "messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages", 400),
    ({"prediction": "def f(): pass"}, "prediction", 400),
    ({"prediction": {"type": "text", "content": "x"}}, "prediction.type", 400),
    ({"prediction": {"type": "content"}}, "prediction.content", 400),
    ({"prediction": {"type": "content", "content": 5}}, "prediction.content", 400),
    ({"prediction": {"type": "content", "content": [{"type": "image_url"}]}}, "prediction.content[0].type", 400),
    ({"prediction": {"type": "content", "content": "x", "mode": "fast"}}, "prediction.mode", 400),
    ({"prediction": {"type": "content", "content": "a b " * 40}}, "prediction", 400),  # past the context (64)
    ({"metadata": "team-a"}, "metadata", 400),
    ({"metadata": {"team": 1}}, "metadata.team", 400),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", 400),
    ({"metadata": {"k" * 65: "v"}}, "metadata", 400),
    ({"metadata": {"note": "v" * 513}}, "metadata.note", 400),
    ({"store": True, "metadata": {"team": "a"}}, "store", 400),
    ({"top_k": -2}, "top_k", 400),
    ({"top_k": 1.5}, "top_k", 400),
    ({"min_p": 1.5}, "min_p", 400),
    ({"min_p": "low"}, "min_p", 400),
    ({"stop_token_ids": [-1]}, "stop_token_ids", 400),
    ({"stop_token_ids": [99999]}, "stop_token_ids", 400),  # the service's check (the vocabulary), named as sent
    ({"tandem": {"stop_token_ids": [99999]}}, "tandem.stop_token_ids", 400),
    ({"top_k": 5, "tandem": {"top_k": 6}}, "tandem.top_k", 400),
    ({"ignore_eos": False, "tandem": {"ignore_eos": True}}, "tandem.ignore_eos", 400),
    ({"stop_token_ids": [7], "tandem": {"stop_token_ids": [8]}}, "tandem.stop_token_ids", 400),
    ({"ignore_eos": "yes"}, "ignore_eos", 400),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output", 400),
    ({"skip_special_tokens": False}, "skip_special_tokens", 400),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens", 400),
    ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs", 400),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", 400),  # the request's own field
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", 400),
    ({"chat_template_kwargs": {"repeat": "x"}}, "chat_template_kwargs", 400),  # the template fails on it: a 400
    ({"allowed_token_ids": [3, "a"]}, "allowed_token_ids", 400),
    ({"allowed_token_ids": [99999]}, "allowed_token_ids", 400),  # the service's check: past the vocabulary
    ({"allowed_token_ids": [3], "response_format": {"type": "json_object"}}, "allowed_token_ids", 400),
    ({"bad_words": "damn"}, "bad_words", 400),
    ({"bad_words": ["ok", " "]}, "bad_words", 400),  # the service's check: a blank word
    ({"bad_words": ["w"] * 129}, "bad_words", 400),
    ({"prompt_cache_key": 7}, "prompt_cache_key", 400),
    ({"prompt_cache_key": "k" * 257}, "prompt_cache_key", 400),  # the service's bound, named as this field
    ({"safety_identifier": "u" * 129}, "safety_identifier", 400),
    ({"verbosity": "low"}, "verbosity", 400),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention", 400),
    ({"prompt_cache_options": {"ttl": "1h"}}, "prompt_cache_options", 400),
    ({"model": "gpt-4o"}, "model", 404),
])
def test_fields_tandem_cannot_honour_or_that_are_wrong_are_refused_naming_them(tokenizer, change, param, status):
    async def go():
        async with http_coordinator(tokenizer) as running:
            code, body = await post(running.url + "/chat/completions", {**CHAT, **change})
            assert code == status, body
            error = body["error"]
            assert error["param"] == param and param in error["message"] and error["type"], body
            assert not running.target.calls["Prefill"]  # refused before any worker was called
    run(go())


def test_a_request_past_the_context_is_refused_as_openai_and_vllm_refuse_it(tokenizer):
    """Past the context (64): OpenAI's 400 ``context_length_exceeded`` with the sentence its clients recognise an
    overflow by ("this model's maximum context length is", which LiteLLM matches to raise ContextWindowExceededError,
    whose handlers trim the conversation or fall back to a larger model), naming the length field as the client
    called it; a one-token prompt is "1 token", not "1 tokens"."""
    async def go():
        async with http_coordinator(tokenizer) as running:
            code, body = await post(running.url + "/completions", {"model": MODEL, "prompt": [5], "max_tokens": 64})
            error = body["error"]
            assert code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
            assert error["message"] == ("max_tokens: 64 is too large: this model's maximum context length is 64 "
                                        "tokens, and the prompt is 1 token (64 > 64 - 1)"), body
            code, body = await post(running.url + "/chat/completions", {
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 64})
            error = body["error"]
            assert code == 400 and error["code"] == "context_length_exceeded", body
            assert error["param"] == "max_completion_tokens" and error["message"].startswith(
                "max_completion_tokens: 64 is too large: this model's maximum context length is 64 tokens"), body
            code, body = await post(running.url + "/completions", {"model": MODEL, "prompt": [5] * 64, "max_tokens": 1})
            assert code == 400 and body["error"]["code"] == "context_length_exceeded", body
            assert body["error"]["message"] == ("prompt: this model's maximum context length is 64 tokens, and the "
                                                "prompt is 64 tokens, which leaves no room for an answer; shorten it")
            assert not running.target.calls["Prefill"]  # refused before any worker was called
    run(go())


def test_a_request_a_target_kv_pool_cannot_hold_is_refused_at_once_and_a_default_length_fits_it(tokenizer):
    """Past the KV pool (4 blocks of 16: 64 tokens, less 16 for a round in flight), a request waited for room
    that never came and failed as "out of KV cache; retry later" five minutes on (seen with --kv-cache-tokens
    512 and a 900-token prompt)."""
    async def go():
        async with http_coordinator(tokenizer, info={"total_blocks": 4, "max_context": 1024}) as running:
            code, body = await post(running.url + "/completions", {"model": MODEL, "prompt": [5] * 50,
                                                                   "max_tokens": 2})
            assert code == 400 and body["error"]["code"] == "context_length_exceeded", body
            assert ("this model's maximum context length is 48 tokens here (what a target worker's KV cache holds for "
                    "one sequence, less a round in flight; the model's own is 1024;") in body["error"]["message"]
            code, body = await post(running.url + "/completions", {"model": MODEL, "prompt": [5] * 10,
                                                                   "max_tokens": 40})
            assert code == 400 and body["error"]["param"] == "max_tokens", body
            assert body["error"]["code"] == "context_length_exceeded", body
            assert body["error"]["message"].startswith("max_tokens: 40 is too large: this model's maximum context "
                                                       "length is 48 tokens here")
            assert body["error"]["message"].endswith("and the prompt is 10 tokens (40 > 48 - 10)"), body
            assert not running.target.calls["Prefill"]  # refused before any worker was called
            # a chat without max_tokens: up to the context, which is now what the pool holds
            code, body = await post(running.url + "/chat/completions", {"model": MODEL, "messages": [
                {"role": "user", "content": "hi"}]})
            assert code == 200 and body["choices"][0]["finish_reason"] == "length", body
            assert body["usage"]["total_tokens"] == 48, body["usage"]
            models = await client(running).models.list()  # what a client sizes its prompts by
            assert [m.model_extra["max_model_len"] for m in models.data] == [48]
    run(go())


@pytest.mark.parametrize("change,param", [
    ({"echo": 1}, "echo"), ({"best_of": 3}, "best_of"), ({"prompt": ["a", 2]}, "prompt"),
    ({"prompt": None}, "prompt"), ({"prompt": [1, -2]}, "prompt"), ({"prompt": [1, 99]}, "prompt"),
    ({"suffix": "x"}, "suffix"), ({"logprobs": 30}, "logprobs"),
])
def test_completion_fields_refused(tokenizer, change, param):
    async def go():
        async with http_coordinator(tokenizer) as running:
            code, body = await post(running.url + "/completions", {"prompt": "hi", "max_tokens": 2, **change})
            assert code == 400 and body["error"]["param"] == param, body
    run(go())


@pytest.mark.parametrize("tree,mode", [(True, "on"), (False, "off"), ("auto", "auto"), (None, "")])
def test_the_tree_option_takes_a_mode_or_a_boolean(tree, mode):
    from coordinator.http.schema import parse_completion

    parsed = parse_completion({"prompt": "hi", "tandem": {"tree": tree}})
    assert parsed.request.speculation.tree == mode
    with pytest.raises(Exception, match="tandem.tree"):
        parse_completion({"prompt": "hi", "tandem": {"tree": 2}})


def test_penalties_and_logit_bias_reach_the_target_worker(tokenizer):
    """OpenAI's frequency_penalty, presence_penalty and logit_bias, and vLLM's repetition_penalty, go to the
    workers as the request's sampling options (whose rows apply them: tandem.penalties)."""
    async def go():
        async with http_coordinator(tokenizer) as running:
            code, body = await post(running.url + "/chat/completions", {
                **CHAT, "frequency_penalty": 0.5, "presence_penalty": -0.25, "repetition_penalty": 1.125,
                "logit_bias": {"7": 5, "3": -100}})
            assert code == 200, body
            code, body = await post(running.url + "/completions", {"prompt": "hi", "max_tokens": 2,
                                                                    "frequency_penalty": 1})
            assert code == 200, body
            chat, completion = running.target.samplings
            assert (chat.frequency_penalty, chat.presence_penalty, chat.repetition_penalty) == (0.5, -0.25, 1.125)
            assert dict(chat.logit_bias) == {7: 5.0, 3: -100.0}
            assert completion.frequency_penalty == 1 and completion.repetition_penalty == 1  # 1: none, sent as is
    run(go())


def test_min_tokens_holds_the_stop_tokens_back_on_the_target(tokenizer):
    """vLLM's min_tokens: the target gets it with the request's stop tokens (the model's, and those asked for)."""
    async def go():
        async with http_coordinator(tokenizer) as running:
            code, body = await post(running.url + "/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 3,
                                                                    "tandem": {"stop_token_ids": [7]}})
            assert code == 200, body
            sampling = running.target.samplings[-1]
            assert sampling.min_tokens == 3 and list(sampling.min_tokens_stop_ids) == [1, 7]  # 1: the model's
            code, body = await post(running.url + "/chat/completions", {**CHAT, "max_tokens": 2, "min_tokens": 5})
            assert code == 400 and body["error"]["param"] == "min_tokens" and "0..2" in body["error"]["message"]
            code, body = await post(running.url + "/chat/completions", {
                **CHAT, "max_tokens": 8, "min_tokens": 5, "response_format": {"type": "json_object"}})
            assert code == 400 and body["error"]["param"] == "min_tokens" and "give one" in body["error"]["message"]
            code, body = await post(running.url + "/completions", {"prompt": "hi", "max_tokens": 2})
            assert code == 200 and running.target.samplings[-1].min_tokens == 0
            assert not running.target.samplings[-1].min_tokens_stop_ids
    run(go())


def test_vllms_top_level_sampling_fields_reach_the_target_worker(tokenizer):
    """vLLM's and SGLang's top-level top_k, min_p, ignore_eos and stop_token_ids (what model cards and ``vllm bench
    serve`` send in ``extra_body``) are the request's sampling and stopping options, as ``tandem``'s top_k,
    ignore_eos and stop_token_ids are; the two spellings together must agree. skip_special_tokens at its default
    is taken."""
    async def go():
        async with http_coordinator(tokenizer) as running:
            code, body = await post(running.url + "/chat/completions", {
                **CHAT, "top_k": 20, "min_p": 0.05, "ignore_eos": True, "stop_token_ids": [7], "min_tokens": 1,
                "skip_special_tokens": True, "spaces_between_special_tokens": True, "allowed_token_ids": [9, 7, 9]})
            assert code == 200, body
            sampling = running.target.samplings[-1]
            assert sampling.top_k == 20 and sampling.min_p == pytest.approx(0.05)
            assert sorted(set(sampling.allowed_token_ids)) == [7, 9]
            code, body = await post(running.url + "/completions", {"prompt": "hi", "max_tokens": 2,
                                                                    "bad_words": ["(", "*,"]})
            assert code == 200, body
            # tokenized by the coordinator (this tokenizer spells a word the same after a space): 9 is "("
            assert [list(w.ids) for w in running.target.samplings[-1].bad_word_ids] == [[9], [11, 13]]
            assert list(sampling.min_tokens_stop_ids) == [7]  # ignore_eos: the model's end token (1) is not one
            code, body = await post(running.url + "/completions", {
                "prompt": "hi", "max_tokens": 2, "top_k": -1, "stop_token_ids": [7], "min_tokens": 1,
                "tandem": {"top_k": 0, "stop_token_ids": [7], "ignore_eos": False}})
            assert code == 200, body
            sampling = running.target.samplings[-1]
            assert sampling.top_k == 0 and sampling.min_p == 0  # -1: none, as vLLM spells it
            assert list(sampling.min_tokens_stop_ids) == [1, 7]
    run(go())


def test_benchmark_clients_payloads_are_taken(tokenizer):
    """The bodies serving benchmarks send. ``vllm bench serve`` (vllm/benchmarks/lib/endpoint_request_func.py):
    streamed completions with ``repetition_penalty: 1.0``, ``logprobs: null`` and ``--ignore-eos``, chat with
    text parts and ``max_completion_tokens``, its sampling flags (``--top-k``, ``--min-p``...) at the top level,
    and an ``x-request-id`` header. guidellm 0.8 (its openai_http backend): ``stop: null``, ``ignore_eos`` and
    ``stream_options.continuous_usage_stats``; every one of its requests was a 400 before Tandem took those.
    Each streams its tokens and ends with the usage."""
    bodies = [
        ("/completions", {"model": MODEL, "prompt": "hi", "repetition_penalty": 1.0, "max_tokens": 4,
                          "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                          "ignore_eos": True, "top_k": -1, "min_p": 0.0, "top_p": 1.0, "temperature": 0.0}),
        ("/chat/completions", {"model": MODEL,
                               "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                               "max_completion_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
                               "ignore_eos": True, "top_k": 20, "min_p": 0.05, "temperature": 0.7}),
        ("/chat/completions", {"model": MODEL, "stream": True, "max_completion_tokens": 4, "stop": None,
                               "ignore_eos": True, "messages": [{"role": "user", "content": "hi"}],
                               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ]

    async def go():
        async with http_coordinator(tokenizer) as running:
            for route, body in bodies:
                async with aiohttp.ClientSession() as session, session.post(
                        running.url + route, json=body, headers={"x-request-id": "bench-1"}) as reply:
                    assert reply.status == 200 and reply.headers["X-Request-Id"] == "bench-1", await reply.text()
                    events = [line[len("data: "):] for line in (await reply.text()).splitlines()
                              if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                chunks = [json.loads(e) for e in events[:-1]]
                assert chunks[-1]["usage"]["completion_tokens"] == 4
                assert all(c["id"].endswith("cmpl-bench-1") for c in chunks)
                text = "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                               for c in chunks if c["choices"])
                assert text == TEXT
    run(go())


def test_return_token_ids_gives_the_tokens_the_model_read_and_wrote(tokenizer):
    """vLLM's return_token_ids: ``prompt_token_ids`` (the prompt as the target got it) and each choice's
    ``token_ids``, whole and streamed (the prompt's on the first chunk, each chunk's new tokens), chat and
    completions, echo's prompt first; gRPC's ``return_prompt_token_ids`` alike."""
    from tandem.rpc.tls import open_channel

    async def go():
        async with http_coordinator(tokenizer) as running:
            api = client(running)
            extra = {"return_token_ids": True}
            chat_reply = await api.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=3,
                                                           n=2, extra_body=extra)
            prompt = running.target.prompts[-1]
            assert chat_reply.model_extra["prompt_token_ids"] == prompt
            assert [c.model_extra["token_ids"] for c in chat_reply.choices] == [list(TOKENS[:3])] * 2
            chunks = [c async for c in await api.chat.completions.create(
                model=MODEL, messages=CHAT["messages"], max_tokens=3, stream=True, extra_body=extra)]
            assert [c.model_extra.get("prompt_token_ids") for c in chunks if c.model_extra.get("prompt_token_ids")
                    ] == [prompt]  # once, on the first chunk with tokens
            assert [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []] == list(TOKENS[:3])
            whole = await api.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2, extra_body=extra)
            assert whole.choices[0].model_extra["prompt_token_ids"] == [5, 6]
            assert whole.choices[0].model_extra["token_ids"] == list(TOKENS[:2])
            echoed = await api.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2, echo=True,
                                                  extra_body=extra)
            assert echoed.choices[0].model_extra["token_ids"] == [5, 6, *TOKENS[:2]]
            chunks = [c async for c in await api.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2,
                                                                    stream=True, extra_body=extra)]
            assert [c.choices[0].model_extra.get("prompt_token_ids") for c in chunks][0] == [5, 6]
            assert [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []] == list(TOKENS[:2])
            plain = await api.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2)
            assert "token_ids" not in plain.choices[0].model_extra  # not asked: not sent
            async with open_channel(running.grpc_address, None, aio=True) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                request = generation_pb2.GenerateRequest(text="$%", return_prompt_token_ids=True,
                                                         stopping=generation_pb2.StoppingOptions(max_new_tokens=2))
                reply = await stub.Generate(request)
                assert list(reply.prompt_token_ids) == running.target.prompts[-1] and not reply.prompt_logprobs
                first = await anext(aiter(stub.GenerateStream(request)))
                assert list(first.prompt_token_ids) == running.target.prompts[-1]
    run(go())


def test_tokens_as_token_ids_and_continuous_usage(tokenizer):
    """vLLM's return_tokens_as_token_ids (log-probabilities name each token ``token_id:ID``, chat and completions)
    and stream_options.continuous_usage_stats (each chunk carries its choice's usage so far, with include_usage)."""
    async def go():
        async with http_coordinator(tokenizer) as running:
            api = client(running)
            ids = {"return_tokens_as_token_ids": True}
            reply = await api.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=3,
                                                      logprobs=True, top_logprobs=1, extra_body=ids)
            content = reply.choices[0].logprobs.content
            assert [t.token for t in content] == [f"token_id:{t}" for t in TOKENS[:3]]
            assert all(t.top_logprobs[0].token.startswith("token_id:") for t in content)
            assert content[0].bytes == list(f"token_id:{TOKENS[0]}".encode())
            assert reply.choices[0].message.content == TEXT[:3]  # the text is still text
            completion = await api.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=1,
                                                      extra_body=ids)
            assert completion.choices[0].logprobs.tokens == [f"token_id:{t}" for t in TOKENS[:2]]
            assert completion.choices[0].logprobs.text_offset == [0, 1]  # offsets count the text
            chunks = [c async for c in await api.chat.completions.create(
                model=MODEL, messages=CHAT["messages"], max_tokens=3, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True})]
            prompt = len(running.target.prompts[-1])
            counted = [c.usage for c in chunks if c.choices and c.choices[0].delta.content]
            assert counted and all(u.prompt_tokens == prompt for u in counted)
            assert [u.completion_tokens for u in counted] == sorted(u.completion_tokens for u in counted)
            assert counted[-1].completion_tokens == chunks[-1].usage.completion_tokens == 3
            assert "prompt_token_ids" not in chunks[1].model_extra  # counted, not returned (not asked)
            plain = [c async for c in await api.chat.completions.create(
                model=MODEL, messages=CHAT["messages"], max_tokens=3, stream=True,
                stream_options={"include_usage": True})]
            assert all(c.usage is None for c in plain[:-1])
    run(go())


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tokenizer):
    """vLLM's truncate_prompt_tokens: the target reads the prompt's last k tokens; -1 cuts a prompt longer than
    the context to the longest the server takes (the whole is a 400 otherwise)."""
    async def go():
        async with http_coordinator(tokenizer) as running:
            code, body = await post(running.url + "/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 2,
                                                                    "truncate_prompt_tokens": 2})
            assert code == 200 and running.target.prompts[-1] == [7, 8], body
            assert body["usage"]["prompt_tokens"] == 2
            long = [5 + i % 30 for i in range(100)]  # past this model's context of 64
            code, body = await post(running.url + "/completions", {"prompt": long, "max_tokens": 1})
            assert code == 400 and body["error"]["code"] == "context_length_exceeded", body
            code, body = await post(running.url + "/completions", {"prompt": long, "max_tokens": 1,
                                                                    "truncate_prompt_tokens": -1})
            assert code == 200 and running.target.prompts[-1] == long[-63:], body
            for bad in ({"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": -2},
                        {"truncate_prompt_tokens": 2, "echo": True}):
                code, body = await post(running.url + "/completions", {"prompt": "hi", "max_tokens": 1, **bad})
                assert code == 400 and body["error"]["param"] == "truncate_prompt_tokens", (bad, body)
    run(go())


def test_include_stop_str_in_output_ends_the_text_after_the_stop_string(tokenizer):
    """vLLM's include_stop_str_in_output: the text ends after the stop string that ended it; without it, before;
    streamed alike."""
    async def go():
        async with http_coordinator(tokenizer) as running:
            stop = [TEXT[1:3]]
            for include, expected in ((False, TEXT[:1]), (True, TEXT[:3])):
                code, body = await post(running.url + "/completions", {
                    "prompt": "hi", "max_tokens": 4, "stop": stop, "include_stop_str_in_output": include})
                assert code == 200, body
                assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (expected, "stop")
                chunks = [c async for c in await client(running).completions.create(
                    model=MODEL, prompt="hi", max_tokens=4, stop=stop, stream=True,
                    extra_body={"include_stop_str_in_output": include})]
                assert "".join(c.choices[0].text for c in chunks) == expected
                assert chunks[-1].choices[0].finish_reason == "stop"
    run(go())


def test_chat_template_kwargs_reach_the_template(tokenizer):
    """vLLM's chat_template_kwargs: extra variables for the chat template (this one writes ``greeting``), on
    chat completions, gRPC's ``ChatMessages.template_kwargs`` and /tokenize alike; a variable the template does
    not read changes nothing."""
    from tandem.rpc.tls import open_channel

    async def go():
        async with http_coordinator(tokenizer) as running:
            turns = [{"role": "user", "content": "$"}]
            plain = list(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)["input_ids"])
            greeted = list(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True,
                                                         greeting="%&")["input_ids"])
            assert greeted != plain
            for kwargs, prompt in (({"greeting": "%&"}, greeted), ({"enable_thinking": False}, plain)):
                code, body = await post(running.url + "/chat/completions", {
                    "messages": turns, "max_tokens": 2, "chat_template_kwargs": kwargs})
                assert code == 200, body
                assert running.target.prompts[-1] == prompt
                code, body = await post(running.url.removesuffix("/v1") + "/tokenize", {
                    "messages": turns, "chat_template_kwargs": kwargs})
                assert code == 200 and body["tokens"] == prompt, body
            for bad in ({"messages": []}, {"repeat": "x"}):  # a name the template is given; a value it fails on
                code, body = await post(running.url.removesuffix("/v1") + "/tokenize", {
                    "messages": turns, "chat_template_kwargs": bad})
                assert code == 400 and body["error"]["param"] == "chat_template_kwargs", body
            async with open_channel(running.grpc_address, None, aio=True) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                request = generation_pb2.GenerateRequest(stopping=generation_pb2.StoppingOptions(max_new_tokens=2))
                request.messages.messages.add(role="user", content="$")
                request.messages.template_kwargs = json.dumps({"greeting": "%&"})
                await stub.Generate(request)
                assert running.target.prompts[-1] == greeted
                request.messages.template_kwargs = "[1]"
                with pytest.raises(grpc.aio.AioRpcError, match="messages.template_kwargs: must be a JSON object"):
                    await stub.Generate(request)
    run(go())


def test_response_formats_reach_the_target_worker(tokenizer):
    """json_object and json_schema go to the workers as the request's sampling options (the target masks its rows
    by them: tandem.structured_output); text asks for nothing."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    async def go():
        async with http_coordinator(tokenizer) as running:
            for fmt in ({"type": "json_schema", "json_schema": {"name": "count", "schema": schema, "strict": True}},
                        {"type": "json_object"}, {"type": "text"}):
                code, body = await post(running.url + "/chat/completions", {**CHAT, "response_format": fmt})
                assert code == 200, body
            code, body = await post(running.url + "/completions", {"prompt": "hi", "max_tokens": 2,
                                                                    "response_format": {"type": "json_object"}})
            assert code == 200, body  # vLLM takes it on completions too
            with_schema, as_object, as_text, completion = running.target.samplings
            assert json.loads(with_schema.json_schema) == schema and not with_schema.json_object
            assert as_object.json_object and not as_object.json_schema
            assert not as_text.json_object and not as_text.json_schema
            assert completion.json_object
    run(go())


def test_neutral_values_of_unsupported_fields_are_taken(tokenizer):
    """What SDKs send by default asks for nothing: accepted as if absent."""
    async def go():
        async with http_coordinator(tokenizer) as running:
            code, body = await post(running.url + "/chat/completions", {
                **CHAT, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": None, "tools": [],
                "response_format": {"type": "text"}, "n": 1, "stream": False, "user": "u-1", "seed": None,
                "logprobs": False, "top_logprobs": 0, "safety_identifier": "u" * 128, "verbosity": "medium",
                "prompt_cache_retention": "in_memory", "prompt_cache_options": None})
            assert code == 200, body
            assert body["choices"][0]["logprobs"] is None
    run(go())


def test_a_prompt_cache_key_reaches_the_service_as_its_routing_key(tokenizer):
    """OpenAI's prompt_cache_key is ``GenerateRequest.cache_key`` (tests/coordinator/test_prefix_routing.py routes
    by it), on chat completions and the Responses API."""
    seen = []

    async def go():
        async with http_coordinator(tokenizer) as running:
            original = running.service._validate
            running.service._validate = lambda request: seen.append(request.cache_key) or original(request)
            code, body = await post(running.url + "/chat/completions", {**CHAT, "prompt_cache_key": "tenant-7"})
            assert code == 200, body
            await client(running).chat.completions.create(  # the official SDK's typed fields, as it sends them
                model=MODEL, messages=CHAT["messages"], max_tokens=2, prompt_cache_key="tenant-9",
                safety_identifier="user-hash-1", verbosity="medium", prompt_cache_retention="in_memory")
            code, body = await post(running.url + "/responses", {"input": "hi", "max_output_tokens": 2,
                                                                 "prompt_cache_key": "tenant-8"})
            assert code == 200, body
            assert seen == ["tenant-7", "tenant-9", "tenant-8"]
    run(go())


def test_each_prefill_says_when_its_request_arrived_and_a_retry_keeps_it_and_asks_to_be_held(tokenizer):
    """The target orders prompts waiting for room by when their requests arrived, whichever coordinator sent them
    (tandem/rpc/room_waits.py): each Prefill carries the request's arrival on the wall clock, and a Prefill asked
    again after a full pool refused it carries the same one (its place), not the time of asking; asked again, it asks
    the target to hold it until room frees (``wait_for_room_s``)."""
    async def go():
        async with http_coordinator(tokenizer) as running:
            target = running.target
            before = time.time()
            target.full_prefills = 2
            code, body = await post(running.url + "/completions", {"prompt": "hi", "max_tokens": 2})
            assert code == 200, body
            code, body = await post(running.url + "/completions", {"prompt": "hello", "max_tokens": 2})
            assert code == 200, body
            first, *retries, second = target.arrivals
            assert len(retries) == 2 and retries == [first, first]  # refused twice, asked again with its arrival
            # asked first to be refused at once (it may move), then to be held for room by the target
            assert target.room_holds == [0.0, ROOM_HOLD_S, ROOM_HOLD_S, 0.0]
            assert before <= first < second <= time.time()
            # its Info polls say the coordinator's clock, by which the target compares the arrivals on its own
            assert target.info_sent_at and all(0 < sent <= time.time() for sent in target.info_sent_at)
        async with http_coordinator(tokenizer, room_hold_s=0.0) as running:  # --room-hold 0: never held
            running.target.full_prefills = 1
            code, body = await post(running.url + "/completions", {"prompt": "hi", "max_tokens": 2})
            assert code == 200, body
            assert running.target.room_holds == [0.0, 0.0]
    run(go())


def test_the_first_waiting_request_tells_the_target_of_those_queued_behind_it(tokenizer):
    """Only the first of the coordinator's requests waiting for room asks again; its Prefills tell the target of the
    others (``queued``, in order), which wait without asking, so that the target keeps their places too."""
    async def go():
        async with http_coordinator(tokenizer) as running:
            target = running.target
            target.full_prefills = 6  # the first is refused until the second has queued behind it
            first = asyncio.ensure_future(post(running.url + "/completions", {"prompt": "hi", "max_tokens": 2}))
            # (refused and waiting in the coordinator's queue: its refusal back, not only its Prefill sent; a second
            # request sent before that asked at once, as first, and was refused too, on a loaded machine)
            while not len(running.service.room_queue):
                await asyncio.sleep(0.01)
            second = asyncio.ensure_future(post(running.url + "/completions", {"prompt": "hello", "max_tokens": 2}))
            assert [code for code, _ in await asyncio.gather(first, second)] == [200, 200]
            head = target.queued[0][0]
            told = [behind for seq_id, behind in target.queued if seq_id == head and behind]
            (other,) = {seq_id for seq_id, _ in target.queued} - {head}
            assert told and all(behind == [other] for behind in told)
            assert [behind for seq_id, behind in target.queued if seq_id == other] == [[]]  # asked once, when first
    run(go())


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_priority_reaches_the_target_where_the_server_schedules_by_priority(tokenizer, policy):
    """vLLM's ``priority`` (chat, completions, the Responses API, gRPC): told to the target with the request's
    Prefill under ``--scheduling-policy priority``; under FCFS (the default, as vLLM's) only 0 is taken, and
    another value is a 400 naming the field and the flag."""
    async def go():
        async with http_coordinator(tokenizer, scheduling_policy=policy) as running:
            code, body = await post(running.url + "/chat/completions", {**CHAT, "priority": 0})
            assert code == 200, body
            requests = [("/chat/completions", {**CHAT, "priority": -3}),
                        ("/completions", {"prompt": "hi", "max_tokens": 2, "priority": 5}),
                        ("/responses", {"input": "hi", "max_output_tokens": 2, "priority": 7})]
            for route, request in requests:
                code, body = await post(running.url + route, request)
                if policy == "priority":
                    assert code == 200, body
                else:
                    assert code == 400 and body["error"]["param"] == "priority", body
                    assert "--scheduling-policy priority" in body["error"]["message"]
            async with grpc.aio.insecure_channel(running.grpc_address) as channel:
                request = generation_pb2.GenerateRequest(text="hi", priority=2)
                request.stopping.max_new_tokens = 2
                call = generation_pb2_grpc.GenerationStub(channel).Generate(request)
                if policy == "priority":
                    await call
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call
                    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert "priority" in refused.value.details()
            expected = [0, -3, 5, 7, 2] if policy == "priority" else [0]
            assert running.target.priorities == expected
            code, body = await post(running.url + "/chat/completions", {**CHAT, "priority": 2**31})
            assert code == 400 and body["error"]["param"] == "priority", body
    run(go())


def test_a_prediction_reaches_the_service_and_metadata_is_taken(tokenizer):
    """OpenAI's Predicted Outputs: the prediction's text (content parts joined as a message's are) becomes
    ``speculation.prediction``; the usage counts what verification made of it (nothing here: this target is
    never sent drafts). Metadata within OpenAI's bounds is taken."""
    seen = []

    async def go():
        async with http_coordinator(tokenizer) as running:
            original = running.service._validate
            running.service._validate = lambda request: seen.append(request.speculation.prediction) or original(
                request)
            parts = {"type": "content", "content": [{"type": "text", "text": "a b"}, {"type": "text", "text": "c"}]}
            code, body = await post(running.url + "/chat/completions", {
                **CHAT, "prediction": parts, "metadata": {"team": "search", "k" * 64: "v" * 512}})
            assert code == 200, body
            assert seen == ["a b\nc"]
            assert body["usage"]["completion_tokens_details"] == {
                "reasoning_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    run(go())


@pytest.mark.parametrize("body", [b"{", b"\xff\xfe{}", b'{"messages": NaN}', b"[1, 2]", b"", b'"text"',
                                  b"[" * 100_000, b'{"messages": [{"role": "user", "content": "\\ud800"}]}'])
def test_malformed_bodies_are_400_in_openai_shape(tokenizer, body):
    async def go():
        async with http_coordinator(tokenizer) as running:
            code, reply = await post(running.url + "/chat/completions", body, raw=True)
            assert code == 400 and reply["error"]["type"] == "invalid_request_error", reply
    run(go())


def test_a_body_over_the_size_limit_is_413_and_a_prompt_over_its_limit_an_overflow(tokenizer):
    """A body past --max-request-bytes is HTTP's 413; a prompt past --max-prompt-tokens is, to the client, a prompt
    too long for the context: OpenAI's 400 ``context_length_exceeded`` with the sentence clients match."""
    async def go():
        async with http_coordinator(tokenizer, max_request_bytes=4096, max_prompt_tokens=10) as running:
            code, body = await post(running.url + "/completions", {"prompt": "x" * 5000})
            assert code == 413 and body["error"]["code"] == "request_too_large"
            code, body = await post(running.url + "/completions", {"prompt": "x" * 20, "max_tokens": 2})
            assert code == 400 and body["error"]["code"] == "context_length_exceeded"
            assert body["error"]["param"] == "prompt"
            assert "takes prompts of at most 10 (this model's maximum context length is 64 tokens)" \
                in body["error"]["message"], body
    run(go())


def test_routes_and_methods_that_do_not_exist_answer_in_openai_shape(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running, aiohttp.ClientSession() as session:
            async with session.post(running.url + "/embeddings", json={}) as reply:
                message = (await reply.json())["error"]["message"]
                assert reply.status == 404 and message.startswith("POST /v1/embeddings: Not Found; this server answers")
                assert "POST /v1/chat/completions" in message and "GET /v1/models" in message  # what is served
            async with session.get(running.url + "/chat/completions") as reply:
                message = (await reply.json())["error"]["message"]
                assert reply.status == 405 and "POST /v1/chat/completions" in message
    run(go())


# ----- auth, limits, lifecycle ------------------------------------------------------------------------------------

def test_bearer_tokens_as_grpc(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, tokens=(TOKEN,)) as running:
            with pytest.raises(openai.AuthenticationError) as refused:
                await client(running, api_key="wrong-token-0123456789").chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert "not valid" in str(refused.value) and "wrong-token" not in str(refused.value)
            code, body = await post(running.url + "/completions", {"prompt": "hi"})
            assert code == 401 and "Authorization: Bearer" in body["error"]["message"]
            reply = await client(running, api_key=TOKEN).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert reply.choices[0].message.content == TEXT[:2]
            with pytest.raises(openai.AuthenticationError):
                await client(running, api_key="wrong-token-0123456789").models.list()
            async with aiohttp.ClientSession() as session, session.get(running.root + "/health") as health:
                assert health.status == 200  # probes need no token
    run(go())


def test_per_client_concurrency_is_one_budget_with_429(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, max_concurrent_per_client=2) as running:
            running.target.gate.clear()  # hold every request in its first round
            first = asyncio.ensure_future(post(running.url + "/completions", {"prompt": "hi", "max_tokens": 2}))
            while not running.target.live:
                await asyncio.sleep(0.01)
            code, body = await post(running.url + "/completions", {"prompt": "hi", "max_tokens": 2, "n": 2})
            assert code == 429 and body["error"]["type"] == "rate_limit_error", body
            running.target.gate.set()
            code, _ = await first
            assert code == 200
            code, _ = await post(running.url + "/completions", {"prompt": "hi", "max_tokens": 2, "n": 2})
            assert code == 200  # the budget is free again
    run(go())


def test_503_while_starting_and_while_draining(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, serve=False) as running:
            async with aiohttp.ClientSession() as session, session.get(running.root + "/health") as reply:
                assert reply.status == 503 and (await reply.json())["error"]["code"] == "starting"
                assert reply.headers["Retry-After"] == "1"
            code, body = await post(running.url + "/completions", {"prompt": "hi"})
            assert code == 503 and body["error"]["code"] == "starting"
        async with http_coordinator(tokenizer) as running:
            running.server.draining = True
            code, body = await post(running.url + "/completions", {"prompt": "hi"})
            assert code == 503 and body["error"]["code"] == "draining"
    run(go())


def test_sagemakers_routes_ping_and_invocations_as_vllm_serves_them(tokenizer):
    """``/ping`` answers as ``/health`` (GET or POST, no token); ``/invocations`` runs a body with messages as a chat
    completion and one with prompt as a completion, streamed too, with the same token; any other body is a 400."""
    async def go():
        async with http_coordinator(tokenizer, serve=False) as running:
            async with aiohttp.ClientSession() as session, session.get(running.root + "/ping") as reply:
                assert reply.status == 503 and (await reply.json())["error"]["code"] == "starting"
        async with http_coordinator(tokenizer, tokens=("client-one-0123456789abcdef",)) as running:
            auth = {"Authorization": "Bearer client-one-0123456789abcdef"}
            async with aiohttp.ClientSession() as session:
                for method in (session.get, session.post):
                    async with method(running.root + "/ping") as reply:  # (no token: a probe holds none)
                        assert reply.status == 200 and (await reply.json()) == {"status": "serving"}
            code, chat = await post(running.root + "/invocations",
                                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, auth)
            assert code == 200 and chat["object"] == "chat.completion"
            assert chat["choices"][0]["message"]["content"] == TEXT[:3]
            code, completion = await post(running.root + "/invocations", {"prompt": "hi", "max_tokens": 2}, auth)
            assert code == 200 and completion["object"] == "text_completion"
            assert completion["choices"][0]["text"] == TEXT[:2]
            async with aiohttp.ClientSession() as session, session.post(
                    running.root + "/invocations", json={"prompt": "hi", "max_tokens": 2, "stream": True},
                    headers=auth) as reply:
                lines = [line.strip() async for line in reply.content if line.strip()]
            assert reply.status == 200 and lines[-1] == b"data: [DONE]"
            code, body = await post(running.root + "/invocations", {"input": "hi"}, auth)
            assert code == 400 and "messages" in body["error"]["message"] and "prompt" in body["error"]["message"]
            code, body = await post(running.root + "/invocations", {"prompt": "hi"})
            assert code == 401 and body["error"]["code"] == "invalid_api_key"
    run(go())


def test_a_client_that_disconnects_mid_stream_cancels_its_request_and_frees_its_kv(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            running.target.gate.clear()
            async with aiohttp.ClientSession() as session:
                reply = await session.post(running.url + "/completions",
                                           json={"prompt": "hi", "max_tokens": 8, "stream": True, "n": 2})
                await reply.content.readline()  # the stream has started
                while len(running.target.live) < 2:
                    await asyncio.sleep(0.01)
                reply.close()  # gone, mid-stream
            for _ in range(200):
                if not running.target.live:
                    break
                await asyncio.sleep(0.02)
            assert not running.target.live and running.target.calls["Release"] == 2
            running.target.gate.set()
            code, body = await post(running.url + "/completions", {"prompt": "hi", "max_tokens": 3})
            assert code == 200 and body["choices"][0]["text"] == TEXT[:3]
    run(go())


def test_a_deadline_in_the_extension_is_504(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            running.target.gate.clear()
            code, body = await post(running.url + "/completions",
                                    {"prompt": "hi", "max_tokens": 4, "tandem": {"timeout_s": 0.2}})
            assert code == 504 and body["error"]["code"] == "timeout", body
            running.target.gate.set()
    run(go())


def test_seeded_choices_get_seeds_of_their_own(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            captured = []
            start = running.service.start

            def spy(request, remaining, *trace):
                captured.append((request.sampling.seed, request.sampling.temperature))
                return start(request, remaining, *trace)
            running.service.start = spy
            code, _ = await post(running.url + "/completions", {"prompt": "hi", "max_tokens": 2, "n": 3, "seed": 5})
            assert code == 200 and [s for s, _ in captured] == [5, 6, 7]
            captured.clear()
            await post(running.url + "/completions", {"prompt": "hi", "max_tokens": 2})
            assert captured == [(0, 1.0)]  # OpenAI's default temperature: sampling
    run(go())


def test_logprob_of_target_reaches_grpc_generate(tokenizer):
    """The gRPC API carries them too (sampling.logprobs), one per token."""
    from tandem.rpc.tls import open_channel

    async def go():
        async with http_coordinator(tokenizer) as running, open_channel(running.grpc_address, None,
                                                                        aio=True) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generation_pb2.GenerateRequest(text="hi", stopping=generation_pb2.StoppingOptions(
                max_new_tokens=3))
            request.sampling.logprobs = 1
            reply = await stub.Generate(request)
            assert [lp.logprob for lp in reply.logprobs] == [LOGPROB] * 3 and list(reply.token_ids) == list(
                TOKENS[:3])
    run(go())
