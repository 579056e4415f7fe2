"""Completions' ``echo`` (the prompt's text, and with ``logprobs`` its tokens' log-probabilities) and a list of
prompts in one call: what lm-evaluation-harness's ``local-completions`` sends for its log-likelihood tasks
(``{"prompt": [[ids]], "echo": true, "logprobs": 1, "max_tokens": 1, "temperature": 0}``), over the scripted
target (tests/http/harness.py), which scores prompt token i ``PROMPT_LOGPROB * i``.
"""

from __future__ import annotations

import pytest

from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.coordinator.inprocess import tiny_tokenizer
from tests.http.harness import LOGPROB, MODEL, PROMPT_LOGPROB, TOKENS, http_coordinator
from tests.http.test_http_api import TEXT, client, post, run


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def spelled(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


def test_echo_starts_each_choice_with_its_prompt_and_asks_the_target_for_nothing_more(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            api = client(running)
            reply = await api.completions.create(model=MODEL, prompt="hello", max_tokens=3, echo=True)
            assert reply.choices[0].text == "hello" + TEXT[:3]
            reply = await api.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2, echo=True, n=2)
            assert [c.text for c in reply.choices] == [tokenizer.decode([5, 6, 7]) + TEXT[:2]] * 2
            assert not any(s.HasField("prompt_logprobs") for s in running.target.samplings)  # no scores asked
            stream = await api.completions.create(model=MODEL, prompt="hello", max_tokens=3, echo=True, stream=True)
            texts = [c.choices[0].text async for c in stream if c.choices]
            assert texts[0].startswith("hello") and "".join(texts) == "hello" + TEXT[:3]
    run(go())


def test_echo_with_logprobs_scores_the_prompt_as_lm_evaluation_harness_reads_it(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            ids = tokenizer.encode("hello there")
            code, body = await post(running.url + "/completions", {
                "model": MODEL, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
                "echo": True})
            assert code == 200, body
            assert running.target.samplings[-1].prompt_logprobs == 1
            [choice] = body["choices"]
            lp = choice["logprobs"]
            assert choice["text"] == tokenizer.decode(ids) + TEXT[:1]
            assert lp["tokens"] == spelled(tokenizer, ids) + [TEXT[0]]
            assert lp["token_logprobs"] == [None, *(PROMPT_LOGPROB * i for i in range(1, len(ids))), LOGPROB]
            assert lp["top_logprobs"][0] is None
            assert lp["top_logprobs"][1:len(ids)] == [{spelled(tokenizer, [t])[0]: PROMPT_LOGPROB * i}
                                                      for i, t in enumerate(ids[1:], start=1)]
            offsets = lp["text_offset"]
            assert offsets[0] == 0 and offsets == sorted(offsets) and len(offsets) == len(ids) + 1
            # lm-evaluation-harness's parse_logprobs: the continuation's sum, and whether it was greedy
            context = 2
            continuation = lp["token_logprobs"][context:-1]
            assert sum(continuation) == sum(PROMPT_LOGPROB * i for i in range(context, len(ids)))
            assert all(tok == max(top.values()) for tok, top in zip(continuation, lp["top_logprobs"][context:-1]))
            assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 1
    run(go())


def test_echo_with_logprobs_streamed_and_through_the_openai_client(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            api = client(running)
            ids = tokenizer.encode("abc")
            reply = await api.completions.create(model=MODEL, prompt="abc", max_tokens=2, echo=True, logprobs=0)
            lp = reply.choices[0].logprobs
            assert lp.token_logprobs == [None, *(PROMPT_LOGPROB * i for i in range(1, len(ids))), LOGPROB, LOGPROB]
            assert lp.top_logprobs is None  # logprobs 0: the tokens' own only
            stream = await api.completions.create(model=MODEL, prompt="abc", max_tokens=2, echo=True, logprobs=1,
                                                  stream=True)
            chunks = [c.choices[0] async for c in stream if c.choices and c.choices[0].logprobs]
            assert chunks[0].logprobs.tokens[:len(ids)] == spelled(tokenizer, ids)  # the first chunk: the prompt
            streamed = [t for c in chunks for t in c.logprobs.token_logprobs]
            assert streamed == [None, *(PROMPT_LOGPROB * i for i in range(1, len(ids))), LOGPROB, LOGPROB]
            offsets = [o for c in chunks for o in c.logprobs.text_offset]
            assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    run(go())


def test_a_list_of_prompts_runs_n_choices_of_each_in_order(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            captured = []
            start = running.service.start

            def spy(request, remaining, *trace):
                captured.append((request.WhichOneof("input"), request.text or list(request.token_ids.ids),
                                 request.sampling.seed))
                return start(request, remaining, *trace)
            running.service.start = spy
            prompts = ["a", "bb", [5, 6]]
            code, body = await post(running.url + "/completions", {"prompt": prompts, "max_tokens": 2, "n": 2,
                                                                   "seed": 9, "echo": True})
            assert code == 200, body
            assert captured == [("text", "a", 9), ("text", "a", 10), ("text", "bb", 9), ("text", "bb", 10),
                                ("token_ids", [5, 6], 9), ("token_ids", [5, 6], 10)]
            assert [c["index"] for c in body["choices"]] == list(range(6))
            echoes = ["a", "a", "bb", "bb", tokenizer.decode([5, 6]), tokenizer.decode([5, 6])]
            assert [c["text"] for c in body["choices"]] == [e + TEXT[:2] for e in echoes]
            lengths = [len(tokenizer.encode("a")), len(tokenizer.encode("bb")), 2]
            assert body["usage"]["prompt_tokens"] == sum(lengths)  # each prompt once, not once per choice
            assert body["usage"]["completion_tokens"] == 12
    run(go())


@pytest.mark.parametrize("prompt,message", [
    ([[1]] * 65, "65 prompts x n 1 is 65 completions"),
    (["a", []], "prompt[1] is empty"),
    (["a", [1, "x"]], "prompt[1]: a string, or a list of token ids"),
    ([], "prompt is empty"),
    ("", "prompt: empty (nothing to continue): give some text"),  # (was "prompt: prompt is empty")
])
def test_bad_prompt_lists_are_refused_naming_the_prompt(tokenizer, prompt, message):
    async def go():
        async with http_coordinator(tokenizer) as running:
            code, body = await post(running.url + "/completions", {"prompt": prompt, "max_tokens": 2})
            assert code == 400 and body["error"]["param"] == "prompt" and message in body["error"]["message"], body
            assert not running.target.calls["Prefill"]
            code, body = await post(running.url + "/completions", {"prompt": "a", "echo": "yes"})
            assert code == 400 and body["error"]["param"] == "echo"
    run(go())


def test_grpc_carries_the_prompt_scores_on_the_first_message_only(tokenizer):
    from tandem.rpc.tls import open_channel

    async def go():
        async with http_coordinator(tokenizer) as running, open_channel(running.grpc_address, None,
                                                                        aio=True) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[4, 8, 15, 16]),
                                                     stopping=generation_pb2.StoppingOptions(max_new_tokens=3))
            request.sampling.prompt_logprobs = 1
            messages = [m async for m in stub.GenerateStream(request)]
            assert list(messages[0].prompt_token_ids) == [4, 8, 15, 16]
            assert [s.logprob for s in messages[0].prompt_logprobs] == [PROMPT_LOGPROB * i for i in (1, 2, 3)]
            assert [list(s.top_ids) for s in messages[0].prompt_logprobs] == [[8], [15], [16]]
            assert all(not m.prompt_logprobs and not m.prompt_token_ids for m in messages[1:])
            assert [t for m in messages for t in m.token_ids] == list(TOKENS[:3])
            whole = await stub.Generate(request)
            assert [s.logprob for s in whole.prompt_logprobs] == [PROMPT_LOGPROB * i for i in (1, 2, 3)]
            assert list(whole.prompt_token_ids) == [4, 8, 15, 16]
            request.sampling.prompt_logprobs = 21
            with pytest.raises(Exception, match="prompt_logprobs must be in 0..20"):
                await stub.Generate(request)
    run(go())


def test_a_batch_larger_than_the_clients_budget_is_400_not_a_429_to_retry(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, max_concurrent_per_client=4) as running:
            code, body = await post(running.url + "/completions", {"prompt": ["a", "b", "c"], "n": 2})
            assert code == 400 and body["error"]["param"] == "prompt", body
            assert "starts 6 completions" in body["error"]["message"] and "at most 4" in body["error"]["message"]
            code, body = await post(running.url + "/completions", {"prompt": "a", "n": 5})
            assert code == 400 and body["error"]["param"] == "n", body
            code, body = await post(running.url + "/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 1})
            assert code == 200 and len(body["choices"]) == 4
    run(go())


def test_max_tokens_0_with_echo_scores_the_prompt_and_writes_nothing(tokenizer):
    """OpenAI's legacy way to score a text: the prompt and its scores, no completion (the target's one token,
    which it must compute to score the last row anyway, is dropped)."""
    async def go():
        async with http_coordinator(tokenizer) as running:
            ids = tokenizer.encode("abc")
            code, body = await post(running.url + "/completions", {"prompt": [ids], "max_tokens": 0, "echo": True,
                                                                   "logprobs": 1})
            assert code == 200, body
            [choice] = body["choices"]
            assert choice["text"] == tokenizer.decode(ids) and choice["finish_reason"] == "length"
            assert choice["logprobs"]["token_logprobs"] == [None, *(PROMPT_LOGPROB * i for i in range(1, len(ids)))]
            assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
            stream = await client(running).completions.create(model=MODEL, prompt="abc", max_tokens=0, echo=True,
                                                              stream=True)
            assert "".join([c.choices[0].text async for c in stream if c.choices]) == "abc"
            code, body = await post(running.url + "/completions", {"prompt": "abc", "max_tokens": 0})
            assert code == 400 and body["error"]["param"] == "max_tokens" and "only with echo" in body["error"][
                "message"]
    run(go())


def test_vllms_prompt_logprobs_score_each_prompt_token_with_its_rank(tokenizer):
    """vLLM's extension: per prompt token (None for the first) its id's logprob, rank and decoded text, with its
    alternatives'; on each completions choice, once at the top of a chat completion; refused streamed (as vLLM)
    and where echo asks other alternatives."""
    async def go():
        async with http_coordinator(tokenizer) as running:
            ids = tokenizer.encode("hello there")
            code, body = await post(running.url + "/completions", {
                "model": MODEL, "prompt": [ids], "max_tokens": 1, "prompt_logprobs": 2, "n": 2, "temperature": 0})
            assert code == 200, body
            # scored once, for both choices (test_each_prompt_is_scored_once_however_many_choices_it_has)
            assert [s.prompt_logprobs for s in running.target.samplings if s.HasField("prompt_logprobs")] == [2]
            for choice in body["choices"]:
                scores = choice["prompt_logprobs"]
                assert scores[0] is None and len(scores) == len(ids)
                for i, (token, entry) in enumerate(zip(ids[1:], scores[1:]), start=1):
                    assert entry[str(token)] == {"logprob": PROMPT_LOGPROB * i, "rank": 1,
                                                 "decoded_token": tokenizer.decode([token])}
                    assert entry["3"] == {"logprob": -9.0, "rank": 2, "decoded_token": tokenizer.decode([3])}
                assert choice["logprobs"] is None  # the output's own were not asked
            code, chat = await post(running.url + "/chat/completions", {
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                "prompt_logprobs": 0})
            assert code == 200, chat
            prompt = running.target.prompts[-1]
            assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(prompt)
            assert list(chat["prompt_logprobs"][-1]) == [str(prompt[-1])]  # no alternatives asked: the token alone
            for fields, why in [({"stream": True}, "stream"), ({"echo": True, "logprobs": 1}, "differs")]:
                code, refused = await post(running.url + "/completions", {
                    "model": MODEL, "prompt": "hi", "max_tokens": 1, "prompt_logprobs": 2, **fields})
                assert code == 400 and refused["error"]["param"] == "prompt_logprobs", refused
                assert why in refused["error"]["message"]
            code, same = await post(running.url + "/completions", {
                "model": MODEL, "prompt": [ids], "max_tokens": 1, "prompt_logprobs": 1, "echo": True, "logprobs": 1})
            assert code == 200 and same["choices"][0]["logprobs"]["token_logprobs"][1] == PROMPT_LOGPROB
            assert same["choices"][0]["prompt_logprobs"][1][str(ids[1])]["logprob"] == PROMPT_LOGPROB
    run(go())


def test_each_prompt_is_scored_once_however_many_choices_it_has(tokenizer):
    """A prompt's n choices share its scores: only its first choice asks the target for them (the others would
    compute the same again), and every choice's reply carries them; streamed, each choice scores its own."""
    async def go():
        async with http_coordinator(tokenizer) as running:
            ids, other = tokenizer.encode("hello there"), [5, 6, 7]
            code, body = await post(running.url + "/completions", {
                "model": MODEL, "prompt": [ids, other], "max_tokens": 1, "n": 3, "echo": True, "logprobs": 1,
                "prompt_logprobs": 1})
            assert code == 200, body
            asked = [s.prompt_logprobs if s.HasField("prompt_logprobs") else None for s in running.target.samplings]
            assert sorted(asked, key=str) == [1, 1, None, None, None, None]  # one scored Prefill per prompt
            for choice in body["choices"]:
                prompt = ids if choice["index"] < 3 else other
                expected = [None, *(PROMPT_LOGPROB * i for i in range(1, len(prompt)))]
                assert choice["logprobs"]["token_logprobs"][:len(prompt)] == expected  # echo's
                assert [e and e[str(t)]["logprob"] for t, e in zip(prompt, choice["prompt_logprobs"])] == expected
            running.target.samplings.clear()
            code, chat = await post(running.url + "/chat/completions", {
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "n": 2,
                "prompt_logprobs": 0})
            assert code == 200 and len(chat["choices"]) == 2 and chat["prompt_logprobs"][1] is not None
            assert [s.HasField("prompt_logprobs") for s in running.target.samplings].count(True) == 1
            running.target.samplings.clear()
            stream = await client(running).completions.create(model=MODEL, prompt="abc", max_tokens=1, n=2, echo=True,
                                                              logprobs=1, stream=True)
            firsts = {}
            async for chunk in stream:
                for c in chunk.choices:
                    if c.logprobs is not None:
                        firsts.setdefault(c.index, c.logprobs.token_logprobs[:3])
            assert firsts[0] == firsts[1] == [None, PROMPT_LOGPROB, 2 * PROMPT_LOGPROB]
            assert [s.prompt_logprobs for s in running.target.samplings] == [1, 1]  # streamed: each its own
    run(go())
