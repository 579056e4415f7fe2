"""Fill in the middle over HTTP: OpenAI's completions ``suffix`` through the official ``openai`` client, over the
scripted target (tests/http/harness.py) and a tiny tokenizer with Qwen2.5-Coder's marker tokens. What the target
is sent is the model's own prompt, its format's end token ends the middle, and what cannot be honoured is refused by
name; a model without markers refuses ``suffix``."""

from __future__ import annotations

import openai
import pytest

from tandem.errors import InvalidRequestError
from tandem.v1 import generation_pb2
from tests.coordinator.inprocess import tiny_tokenizer
from tests.http.harness import MODEL, http_coordinator
from tests.http.test_http_api import client, post, run
from tests.http.test_http_tools import INFO, VOCAB, spell
from tests.tiny_models import TINY_FIM_SPECIALS, save_tiny_tokenizer

PREFIX, SUFFIX = "f=lambda(x):", "print(f(2))"  # (the tiny tokenizer drops spaces)
END = 6  # <|endoftext|>: the format's end token, not among the model's own stop ids (the fake target's is 1)


@pytest.fixture(scope="module")
def fim_tokenizer(tmp_path_factory):
    from tandem.tokenizer import load_tokenizer

    out = tmp_path_factory.mktemp("fim-tokenizer")
    save_tiny_tokenizer(out, VOCAB, eos_token_id=1, bos_token_id=0, extra_specials=TINY_FIM_SPECIALS)
    return load_tokenizer(out)


def infill_ids(tokenizer, prefix: str, suffix: str) -> list[int]:
    """The prompt spelled independently of tandem.infill: the joined text with the markers as special tokens."""
    return tokenizer.encode(f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>", add_special_tokens=False)


def test_a_suffix_makes_the_models_infill_prompt_and_its_end_token_ends_the_middle(fim_tokenizer):
    async def go():
        async with http_coordinator(fim_tokenizer, info=INFO) as running:
            running.target.script = [*spell(fim_tokenizer, "x*x"), END]
            reply = await client(running).completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX,
                                                              max_tokens=16, temperature=0)
            assert running.target.prompts[-1] == infill_ids(fim_tokenizer, PREFIX, SUFFIX)
            assert reply.choices[0].text == "x*x" and reply.choices[0].finish_reason == "stop"
            assert reply.usage.prompt_tokens == len(running.target.prompts[-1])
            assert reply.usage.completion_tokens == 4  # the end token counts as generated, as an EOS does
            # The same script without a suffix: the end token is no stop of a plain completion, which runs on
            plain = await client(running).completions.create(model=MODEL, prompt=PREFIX, max_tokens=6, temperature=0)
            assert plain.choices[0].finish_reason == "length"
            assert running.target.prompts[-1] == fim_tokenizer.encode(PREFIX, add_special_tokens=True)
    run(go())


def test_streamed_and_batched_infills_each_get_their_own_prefix(fim_tokenizer):
    async def go():
        async with http_coordinator(fim_tokenizer, info=INFO) as running:
            running.target.script = [*spell(fim_tokenizer, "ab"), END]
            chunks = [c async for c in await client(running).completions.create(
                model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=16, temperature=0, stream=True)]
            assert "".join(c.choices[0].text for c in chunks if c.choices) == "ab"
            assert chunks[-1].choices[0].finish_reason == "stop"
            running.target.prompts.clear()
            reply = await client(running).completions.create(model=MODEL, prompt=["a=1", "b=2"], suffix=SUFFIX,
                                                              max_tokens=16, temperature=0)
            assert sorted(running.target.prompts) == sorted([infill_ids(fim_tokenizer, "a = 1", SUFFIX),
                                                             infill_ids(fim_tokenizer, "b = 2", SUFFIX)])
            assert [c.text for c in reply.choices] == ["ab", "ab"]
            # An empty prefix (the cursor at the top of the file) is a prompt too; an empty suffix asks for nothing
            await client(running).completions.create(model=MODEL, prompt="", suffix=SUFFIX, max_tokens=4)
            assert running.target.prompts[-1] == infill_ids(fim_tokenizer, "", SUFFIX)
            await client(running).completions.create(model=MODEL, prompt=PREFIX, suffix="", max_tokens=4)
            assert running.target.prompts[-1] == fim_tokenizer.encode(PREFIX, add_special_tokens=True)
    run(go())


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"echo": True}, "echo", "not with suffix"),
    ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens", "not with suffix"),
    ({"prompt": [3, 9, 11]}, "suffix", "needs text prompts"),
    ({"suffix": 7}, "suffix", "string"),
])
def test_what_an_infill_cannot_honour_is_refused_by_name(fim_tokenizer, extra, param, message):
    async def go():
        async with http_coordinator(fim_tokenizer, info=INFO) as running:
            code, body = await post(running.url + "/completions", {"model": MODEL, "prompt": PREFIX, "suffix": SUFFIX,
                                                                   "max_tokens": 4, **extra})
            assert code == 400, body
            assert body["error"]["param"] == param and message in body["error"]["message"], body
            assert not running.target.prompts  # nothing reached the target
    run(go())


def test_tokenize_with_a_suffix_gives_the_prompt_a_completion_with_it_sends(fim_tokenizer):
    """An editor sizes what it sends by /tokenize: with ``suffix``, the infill prompt, its markers counted."""
    async def go():
        async with http_coordinator(fim_tokenizer, info=INFO) as running:
            code, body = await post(running.root + "/tokenize", {"model": MODEL, "prompt": PREFIX, "suffix": SUFFIX})
            assert code == 200 and body["tokens"] == infill_ids(fim_tokenizer, PREFIX, SUFFIX), body
            assert body["count"] == len(body["tokens"])
            running.target.script = [END]
            await client(running).completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=4)
            assert running.target.prompts[-1] == body["tokens"]
            code, plain = await post(running.root + "/tokenize", {"prompt": PREFIX, "suffix": ""})
            assert code == 200 and plain["tokens"] == fim_tokenizer.encode(PREFIX)  # an empty suffix asks nothing
            code, refused = await post(running.root + "/tokenize", {"prompt": PREFIX, "suffix": SUFFIX,
                                                                    "add_special_tokens": False})
            assert code == 400 and refused["error"]["param"] == "add_special_tokens", refused
    run(go())


def test_a_model_without_markers_refuses_a_suffix_naming_it(tmp_path):
    tokenizer = tiny_tokenizer(tmp_path)

    async def go():
        async with http_coordinator(tokenizer) as running:
            with pytest.raises(openai.BadRequestError) as refused:
                await client(running).completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=4)
            error = refused.value.body
            assert error["param"] == "suffix" and "no fill-in-the-middle tokens" in error["message"], error
            assert not running.target.prompts
            code, body = await post(running.root + "/tokenize", {"prompt": PREFIX, "suffix": SUFFIX})
            assert code == 400 and body["error"]["param"] == "suffix", body
            assert "no fill-in-the-middle tokens" in body["error"]["message"]
    run(go())


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: setattr(r.infill, "prefix", ""), "both prefix and suffix are empty"),
    (lambda r: setattr(r, "chat", True), "chat: not with infill"),
    (lambda r: setattr(r, "truncate_prompt_tokens", 8), "truncate_prompt_tokens: not with infill"),
])
def test_the_grpc_infill_is_refused_where_it_cannot_be_a_prompt(fim_tokenizer, change, message):
    async def go():
        async with http_coordinator(fim_tokenizer, info=INFO) as running:
            request = generation_pb2.GenerateRequest(infill=generation_pb2.Infill(prefix="", suffix=""))
            if "both" not in message:
                request.infill.prefix = PREFIX
            change(request)
            with pytest.raises(InvalidRequestError, match=message):
                running.service.start(request, None)
    run(go())
