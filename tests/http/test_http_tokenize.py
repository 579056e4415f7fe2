"""vLLM's tokenizer routes on the coordinator (coordinator/http/tokenize.py): /tokenize, /detokenize and
/tokenizer_info, over the scripted target (tests/http/harness.py) and the tiny real tokenizer, whose chat
template refuses a first turn with ``!``."""

from __future__ import annotations

import aiohttp
import pytest

from tests.coordinator.inprocess import MAX_CONTEXT, tiny_tokenizer
from tests.http.harness import MODEL, http_coordinator
from tests.http.test_http_api import TOKEN, client, post, run

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


async def get(url: str, headers=None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as reply:
        return reply.status, await reply.json(content_type=None)


def test_tokenize_a_prompt_as_completions_read_it(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            code, body = await post(running.root + "/tokenize", {"model": MODEL, "prompt": "hello there"})
            assert code == 200, body
            ids = tokenizer.encode("hello there", add_special_tokens=True)
            assert body == {"count": len(ids), "max_model_len": MAX_CONTEXT, "tokens": ids}
            await client(running).completions.create(model=MODEL, prompt="hello there", max_tokens=1)
            assert running.target.prompts[-1] == ids  # what the model is sent
            code, bare = await post(running.root + "/tokenize", {"prompt": "hello there", "add_special_tokens": False,
                                                                 "return_token_strs": True})
            assert bare["tokens"] == tokenizer.encode("hello there", add_special_tokens=False)
            assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])
    run(go())


def test_tokenize_a_conversation_as_chat_completions_render_it(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            code, body = await post(running.root + "/tokenize", {"messages": MESSAGES})
            assert code == 200, body
            await client(running).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
            assert body["tokens"] == running.target.prompts[-1] and body["count"] == len(body["tokens"])
            code, open_turn = await post(running.root + "/tokenize", {"messages": MESSAGES,
                                                                      "continue_final_message": True})
            assert code == 200 and open_turn["tokens"] == body["tokens"][:len(open_turn["tokens"])]
            assert tokenizer.decode(body["tokens"]).endswith("#")  # the template's generation prompt
            assert not tokenizer.decode(open_turn["tokens"]).endswith("#")
    run(go())


def test_detokenize_round_trips_and_tokenizer_info_names_the_special_tokens(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            ids = tokenizer.encode("hello there", add_special_tokens=False)
            code, body = await post(running.root + "/detokenize", {"tokens": ids, "model": MODEL})
            assert code == 200 and body == {"prompt": tokenizer.decode(ids)}
            code, info = await get(running.root + "/tokenizer_info")
            assert code == 200
            assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
            assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == MAX_CONTEXT
            assert info["tokenizer_class"] == type(tokenizer).__name__
    run(go())


@pytest.mark.parametrize("route,body,param,message", [
    ("/tokenize", {}, "prompt", "required"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt", "not both"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message", "give one"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi!"}]}, "messages", "exclamation marks"),
    ("/tokenize", {"prompt": "a", "tools": []}, "tools", "only with messages"),
    ("/tokenize", {"messages": MESSAGES, "tools": [], "tool_chioce": "auto"}, "tool_chioce", "unknown field"),
    ("/detokenize", {"tokens": [1, 999]}, "tokens", "999"),
    ("/detokenize", {"tokens": [-1]}, "tokens", ">= 0"),
    ("/detokenize", {"tokens": "hi"}, "tokens", "a list of token ids"),
])
def test_bad_tokenizer_requests_are_400_naming_the_field(tokenizer, route, body, param, message):
    async def go():
        async with http_coordinator(tokenizer) as running:
            code, reply = await post(running.root + route, body)
            assert code == 400 and reply["error"]["param"] == param, reply
            assert message in reply["error"]["message"], reply
    run(go())


def test_tokenizer_routes_take_the_bearer_token_and_the_served_model_name(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, tokens=(TOKEN,)) as running:
            code, _ = await post(running.root + "/tokenize", {"prompt": "a"})
            assert code == 401
            code, _ = await get(running.root + "/tokenizer_info")
            assert code == 401
            auth = {"Authorization": f"Bearer {TOKEN}"}
            code, body = await post(running.root + "/tokenize", {"prompt": "a", "model": "gpt-4o"}, headers=auth)
            assert code == 404 and body["error"]["param"] == "model"
            code, _ = await get(running.root + "/tokenizer_info", headers=auth)
            assert code == 200
    run(go())
