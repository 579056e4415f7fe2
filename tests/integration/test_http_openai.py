"""The OpenAI-compatible HTTP API on a real coordinator, through the official ``openai`` client.

The session's shared SmolLM2 cluster (tests/integration/conftest.py, its coordinator started with
``--http-port 0``): greedy text equal to the gRPC API's and to target-only decoding, the target's own
log-probabilities (checked against one plain forward pass of the model), streaming, n choices, seeds, stop
strings, usage, Tandem's extension field, and a client that disconnects mid-stream freeing its KV. The
fast, model-free tests of the same API are in tests/http.
"""

from __future__ import annotations

import math
import time

import openai
import pytest

from tandem.client import build_request
from tests.integration.conftest import MAX_NEW_TOKENS, PROMPTS, SHARED_DTYPE

pytestmark = pytest.mark.slow

# The served log-probabilities equal target-only decoding's bitwise (the row-invariant kernels: measured 0.0 in bf16
# and fp32, in process and here). One forward pass over the whole text computes other shapes: in bf16 its logits
# round differently, measured up to 0.17 nats apart on these prompts (1e-5 in fp32, which tests/spec checks at
# 1e-4); a wrong row (an off-by-one, another token's probability) is whole nats off.
ONE_PASS_TOLERANCE = 0.3


@pytest.fixture(scope="module")
def api(shared_cluster):
    url = shared_cluster.coordinator.http_url
    assert url, "the shared cluster's coordinator serves HTTP"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(api):
    [card] = api.models.list().data
    return card.id


def chat(api, model, prompt, **kw):
    return api.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], **kw)


def test_models_names_the_target_and_its_context(api, shared_client):
    [card] = api.models.list().data
    info = shared_client.info()
    assert card.id == info.target_model and card.model_extra["max_model_len"] == info.max_context > 0


def test_greedy_text_equals_grpc_and_target_only_and_logprobs_are_the_targets(api, model, shared_client,
                                                                               smollm2_reference, smollm2_dir):
    from tandem.tokenizer import encode_prompt, load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    scored = {}
    for prompt in PROMPTS[:2]:
        reply = chat(api, model, prompt, max_tokens=MAX_NEW_TOKENS, temperature=0, logprobs=True, top_logprobs=2)
        grpc_reply = shared_client.generate(build_request(prompt, chat=True, max_new_tokens=MAX_NEW_TOKENS))
        expected = smollm2_reference[prompt]
        choice = reply.choices[0]
        assert list(grpc_reply.token_ids) == expected
        assert choice.message.content == grpc_reply.text, prompt
        assert reply.usage.completion_tokens == len(expected) == len(choice.logprobs.content)
        assert reply.usage.prompt_tokens == len(encode_prompt(tokenizer, prompt, chat=True))
        assert reply.usage.prompt_tokens_details.cached_tokens == choice.model_extra["tandem"]["prompt_tokens_reused"]
        assert [t.token for t in choice.logprobs.content] == [tokenizer.decode([t]) for t in expected]
        scored[prompt] = [t.logprob for t in choice.logprobs.content], [
            [a.logprob for a in t.top_logprobs] for t in choice.logprobs.content]
    check_against_a_target_forward(smollm2_dir, tokenizer, smollm2_reference, {PROMPTS[0]: scored[PROMPTS[0]]})


def test_penalties_and_logit_bias_give_the_penalised_target_only_text(api, model, smollm2_reference, smollm2_dir):
    """OpenAI's penalties and logit_bias and vLLM's repetition_penalty, through the real workers (the draft
    and the target each apply them, row by row): greedy text equals penalised target-only decoding in
    process. The values are exact in float32, the wire's type, so both sides compute the same rows."""
    from tandem.sampling_params import SamplingParams
    from tandem.tokenizer import load_tokenizer
    from tests.references import target_only

    prompt = PROMPTS[0]
    banned = smollm2_reference[prompt][1]  # the plain answer's second token, never to be said
    penalised = SamplingParams(repetition_penalty=1.25, frequency_penalty=0.75, presence_penalty=0.5,
                               logit_bias=((banned, -100.0),))
    expected = target_only(smollm2_dir, [prompt], dtype=SHARED_DTYPE, max_new_tokens=MAX_NEW_TOKENS,
                           sampling=penalised)[prompt]
    reply = chat(api, model, prompt, max_tokens=MAX_NEW_TOKENS, temperature=0, frequency_penalty=0.75,
                 presence_penalty=0.5, logit_bias={str(banned): -100}, extra_body={"repetition_penalty": 1.25})
    assert reply.choices[0].message.content == load_tokenizer(smollm2_dir).decode(expected, skip_special_tokens=True)
    assert expected != smollm2_reference[prompt] and banned not in expected
    assert reply.choices[0].model_extra["tandem"]["drafted"] > 0  # speculation ran under the penalties


def test_a_json_schema_gives_valid_json_equal_to_constrained_target_only(api, model, smollm2_dir):
    """response_format json_schema through the real workers: the text parses under the schema and equals
    target-only decoding in process under the same grammar (greedy)."""
    import json

    from tandem.sampling_params import SamplingParams
    from tandem.tokenizer import load_tokenizer
    from tests.references import target_only

    question = "Give the width and height of a 3 by 4 rectangle as a JSON object."
    schema = {"type": "object", "properties": {"width": {"type": "integer"}, "height": {"type": "integer"}},
              "required": ["width", "height"], "additionalProperties": False}
    expected = target_only(smollm2_dir, [question], dtype=SHARED_DTYPE, max_new_tokens=MAX_NEW_TOKENS,
                           sampling=SamplingParams(json_schema=json.dumps(schema)))[question]
    reply = chat(api, model, question, max_tokens=MAX_NEW_TOKENS, temperature=0,
                 response_format={"type": "json_schema", "json_schema": {"name": "size", "schema": schema}})
    text = reply.choices[0].message.content
    assert text == load_tokenizer(smollm2_dir).decode(expected, skip_special_tokens=True)
    assert reply.choices[0].finish_reason == "stop"
    assert set(json.loads(text)) == {"width", "height"}
    with pytest.raises(openai.BadRequestError) as refused:  # a schema no grammar can hold: 400, naming the field
        chat(api, model, question, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "colour"}}})
    assert refused.value.body["param"] == "response_format"


def test_vllm_choice_and_regex_constraints_give_constrained_target_only_text(api, model, smollm2_dir):
    """vLLM's structured outputs (extra_body, as vLLM's clients send them) through the real workers: the text is
    one of the choices, or matches the pattern whole, and is target-only decoding's under the same grammar."""
    import re

    from tandem.sampling_params import SamplingParams
    from tandem.structured_output import choice_grammar, regex_grammar
    from tandem.tokenizer import load_tokenizer
    from tests.references import target_only

    tokenizer = load_tokenizer(smollm2_dir)
    cases = [("Is the sky green? Answer yes or no.", {"structured_outputs": {"choice": ["yes", "no"]}},
              choice_grammar(["yes", "no"]), lambda text: text in ("yes", "no")),
             ("Write a year in the 1900s.", {"guided_regex": "19[0-9]{2}"}, regex_grammar("19[0-9]{2}"),
              lambda text: re.fullmatch("19[0-9]{2}", text) is not None)]
    for question, extra, grammar, valid in cases:
        expected = target_only(smollm2_dir, [question], dtype=SHARED_DTYPE, max_new_tokens=MAX_NEW_TOKENS,
                               sampling=SamplingParams(grammar=grammar))[question]
        reply = chat(api, model, question, max_tokens=MAX_NEW_TOKENS, temperature=0, extra_body=extra)
        text = reply.choices[0].message.content
        assert valid(text) and reply.choices[0].finish_reason == "stop", text
        assert text == tokenizer.decode(expected, skip_special_tokens=True)


def check_against_a_target_forward(model_dir, tokenizer, reference, scored) -> None:
    """Each served log-probability is target-only decoding's own, and one plain forward pass's (bf16's rounding)."""
    import torch

    from tandem.config import EngineConfig
    from tandem.engine import ForwardItem, ModelEngine
    from tandem.inprocess import GenerationRequest, SpeculativeGenerator
    from tandem.sampling import SamplingParams
    from tandem.tokenizer import encode_prompt, stop_token_ids

    engine = ModelEngine.load(EngineConfig(model_dir, dtype=SHARED_DTYPE, kv_cache_tokens=1024))
    prompts = list(scored)
    ids = [encode_prompt(tokenizer, p, chat=True) for p in prompts]
    stops = stop_token_ids(model_dir, tokenizer, engine.config)
    decoded = SpeculativeGenerator(engine).generate([
        GenerationRequest(i, MAX_NEW_TOKENS, SamplingParams(logprobs=2), stop_token_ids=stops) for i in ids])
    for prompt, prompt_ids, plain in zip(prompts, ids, decoded):
        logprobs, tops = scored[prompt]
        generated = reference[prompt]
        assert plain.token_ids == generated
        assert logprobs == [s.logprob for s in plain.logprobs], prompt  # target-only decoding's, exactly
        sequence = prompt_ids + generated
        [logits] = engine.forward([ForwardItem(prompt, sequence[:-1], num_logits=len(generated))])
        one_pass = torch.log_softmax(logits.float(), -1)[torch.arange(len(generated)), torch.tensor(generated)]
        assert logprobs == pytest.approx(one_pass.tolist(), abs=ONE_PASS_TOLERANCE), prompt
        # greedy: the emitted token is a most likely one (bf16 has ties: which one comes first among equals varies)
        assert [top[0] for top in tops] == logprobs and all(len(top) == 2 for top in tops)


def test_streamed_completion_from_token_ids_equals_the_whole_and_counts_usage(api, model, smollm2_reference,
                                                                              smollm2_dir):
    from tandem.tokenizer import encode_prompt, load_tokenizer

    prompt = PROMPTS[2]
    ids = encode_prompt(load_tokenizer(smollm2_dir), prompt, chat=True)
    whole = api.completions.create(model=model, prompt=ids, max_tokens=MAX_NEW_TOKENS, temperature=0)
    stream = api.completions.create(model=model, prompt=ids, max_tokens=MAX_NEW_TOKENS, temperature=0, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == len(smollm2_reference[prompt])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_seeded_samples_repeat_and_n_choices_differ(api, model):
    def sample():
        reply = chat(api, model, PROMPTS[0], max_tokens=12, temperature=0.9, seed=11, n=2)
        assert [c.index for c in reply.choices] == [0, 1]
        assert reply.usage.completion_tokens == sum(c.model_extra["tandem"]["generated_tokens"] for c in reply.choices)
        return [c.message.content for c in reply.choices]

    first, second = sample(), sample()
    assert first == second  # each choice's seed is the request's seed + its index: repeatable
    assert first[0] != first[1]  # ... and the choices are different samples


def test_stop_strings_cut_the_text_before_them(api, model):
    full = chat(api, model, PROMPTS[1], max_tokens=MAX_NEW_TOKENS, temperature=0).choices[0].message.content
    stop = full[8:14]
    cut = chat(api, model, PROMPTS[1], max_tokens=MAX_NEW_TOKENS, temperature=0, stop=[stop, "never-appears"])
    choice = cut.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == full[:full.index(stop)]


def tempered_gaps(reply, temperature: float) -> list[float]:
    """Each emitted token's log-probability under the tempered law relative to the likeliest token's (0: the
    likeliest, ties included): log(p / p_max), the quantity top-k 1 and min-p filter on."""
    return [(t.logprob - t.top_logprobs[0].logprob) / temperature
            for choice in reply.choices for t in choice.logprobs.content]


def test_vllms_sampling_extras_through_real_workers(api, model, smollm2_reference):
    """What a vLLM user sends in ``extra_body`` (a model card's top_k and min_p, include_stop_str_in_output,
    chat_template_kwargs), through the draft and target processes. Hot samples drafted by the draft model keep
    only what the filter leaves, token by token (read from the target's own log-probabilities): top-k 1 the
    likeliest (or a tie), min-p 0.5 tokens at least half as likely; unfiltered, the same temperature strays
    further. A seeded min-p sample is plain seeded decoding's (method none) with the same min-p. return_token_ids
    gives target-only's tokens. The stop string is kept when asked; a template variable this template does not
    read changes nothing."""
    hot, scored = 1.5, {"logprobs": True, "top_logprobs": 1, "max_tokens": MAX_NEW_TOKENS, "n": 2}
    drafted = {"method": "draft", "k": 3, "fixed_k": True}  # (this draft is the target's model: it never pays)
    top1 = chat(api, model, PROMPTS[1], temperature=hot, extra_body={"top_k": 1, "tandem": drafted},
                **{**scored, "n": 1})
    assert all(gap == 0 for gap in tempered_gaps(top1, hot))
    assert all(c.model_extra["tandem"]["drafted"] > 0 for c in top1.choices)
    half = chat(api, model, PROMPTS[1], temperature=hot, extra_body={"min_p": 0.5, "tandem": drafted}, **scored)
    assert min(tempered_gaps(half, hot)) >= math.log(0.5) - 1e-4
    free = chat(api, model, PROMPTS[1], temperature=hot, seed=3, extra_body={"tandem": drafted}, **scored)
    assert min(tempered_gaps(free, hot)) < math.log(0.5)  # so the bound above is the filter's doing

    def seeded(method: str) -> str:
        reply = chat(api, model, PROMPTS[1], max_tokens=24, temperature=hot, seed=5,
                     extra_body={"min_p": 0.2, "tandem": {"method": method, "k": 3, "fixed_k": True}})
        return reply.choices[0].message.content

    assert seeded("draft") == seeded("none")
    whole = chat(api, model, PROMPTS[1], max_tokens=MAX_NEW_TOKENS, temperature=0,
                 extra_body={"return_token_ids": True})
    greedy = whole.choices[0].message.content
    assert whole.choices[0].model_extra["token_ids"] == smollm2_reference[PROMPTS[1]]  # target-only's tokens
    assert len(whole.model_extra["prompt_token_ids"]) == whole.usage.prompt_tokens
    stop = greedy[8:14]
    kept = chat(api, model, PROMPTS[1], max_tokens=MAX_NEW_TOKENS, temperature=0, stop=[stop],
                extra_body={"include_stop_str_in_output": True, "chat_template_kwargs": {"enable_thinking": False}})
    assert kept.choices[0].finish_reason == "stop"
    assert kept.choices[0].message.content == greedy[:greedy.index(stop) + len(stop)]


def test_the_extension_field_chooses_speculation_and_reports_it(api, model):
    reply = chat(api, model, PROMPTS[3], max_tokens=16, temperature=0,
                 extra_body={"tandem": {"method": "draft", "k": 3, "fixed_k": True, "tree": "off"}})
    stats = reply.choices[0].model_extra["tandem"]
    assert stats["method"] == "draft" and stats["drafted"] > 0 and stats["rounds"] > 0
    assert stats["accepted"] == stats["drafted"] and stats["acceptance"] == 1.0  # the draft is the target's model
    with pytest.raises(openai.BadRequestError) as refused:
        chat(api, model, PROMPTS[3], max_tokens=4, extra_body={"tandem": {"method": "warp"}})
    assert "tandem.method" in str(refused.value)


def test_a_prediction_changes_how_soon_the_answer_comes_not_what_it_is(api, model, smollm2_reference):
    """OpenAI's Predicted Outputs through real workers: the answer with a prediction is target-only's, token for
    token, whether the prediction is the answer itself or an edit of it; with the answer as prediction, rounds
    commit many tokens each (at most half as many rounds as plain decoding's) and the usage counts them. (Those
    rounds use method draft, which never looks in the continuation cache: the cache learned this answer from
    earlier requests, and where its match is longer than the prediction's, as for a repeated request, it
    proposes instead.)"""
    prompt = PROMPTS[0]
    ngram = {"tandem": {"method": "ngram"}}
    plain = chat(api, model, prompt, max_tokens=MAX_NEW_TOKENS, temperature=0,
                 extra_body={"tandem": {"method": "none"}})  # one token a round: what the rounds below are held to
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens == len(smollm2_reference[prompt])
    edited = text[: len(text) // 2] + " (an edit) " + text[len(text) // 2 + 10:]
    for prediction in (text, edited):
        for extra in (ngram, None):  # n-gram rounds; auto (hybrid, beside the draft workers)
            reply = chat(api, model, prompt, max_tokens=MAX_NEW_TOKENS, temperature=0, extra_body=extra,
                         prediction={"type": "content", "content": prediction})
            assert reply.choices[0].message.content == text, (prediction, extra)
    reply = chat(api, model, prompt, max_tokens=MAX_NEW_TOKENS, temperature=0,
                 extra_body={"tandem": {"method": "draft"}}, prediction={"type": "content", "content": text})
    assert reply.choices[0].message.content == text
    details, stats = reply.usage.completion_tokens_details, reply.choices[0].model_extra["tandem"]
    assert details.accepted_prediction_tokens == stats["prediction_accepted"] >= MAX_NEW_TOKENS // 2, stats
    assert details.rejected_prediction_tokens == stats["prediction_rejected"]
    assert stats["rounds"] <= plain.choices[0].model_extra["tandem"]["rounds"] // 2, stats


def test_a_client_that_disconnects_mid_stream_frees_its_kv(api, model, shared_client, shared_cluster):
    from tests.integration.test_services import metric_samples

    def outcomes() -> dict[str, float]:
        samples = metric_samples(shared_cluster.coordinator, "tandem_coordinator_requests_total")
        return {kind: samples.get(f'tandem_coordinator_requests_total{{outcome="{kind}"}}', 0.0)
                for kind in ("ok", "cancelled", "error")}

    def freed() -> bool:
        workers = [*shared_client.info().target_workers, *shared_client.info().draft_workers]
        return all(w.info.free_blocks == w.info.total_blocks and w.info.active_sequences == 0 for w in workers)

    before = outcomes()
    stream = chat(api, model, PROMPTS[0], max_tokens=400, temperature=0, stream=True,
                  extra_body={"tandem": {"ignore_eos": True, "method": "draft"}})
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    stream.close()  # the connection goes: the coordinator cancels the request
    # The workers free the KV when they take the Release; the coordinator counts the request once the Release
    # calls return. Wait for both (a loaded machine can show the first before the second).
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (freed() and outcomes()["cancelled"] == before["cancelled"] + 1):
        time.sleep(0.3)
    assert freed()
    after = outcomes()
    assert after == {**before, "cancelled": before["cancelled"] + 1}, (before, after)  # cancelled, not finished


def test_echo_scores_a_text_as_the_target_said_it_when_it_wrote_it(api, model, shared_client, smollm2_reference,
                                                                      smollm2_dir, shared_cluster):
    """lm-evaluation-harness's log-likelihood request (token ids, echo, logprobs 1, one new token) on the target's own
    greedy answer: the answer's tokens are scored as it scored them when it emitted them, each its row's most
    likely (so the harness reads the answer as greedy), and the prompt's tokens get scores of their own."""
    from tandem.tokenizer import encode_prompt, load_tokenizer

    prompt = PROMPTS[0]
    ids = encode_prompt(load_tokenizer(smollm2_dir), prompt, chat=True)
    answer = smollm2_reference[prompt]
    written = api.completions.create(model=model, prompt=ids, max_tokens=len(answer), temperature=0, logprobs=1)
    assert written.usage.completion_tokens == len(answer)
    echoed = api.completions.create(model=model, prompt=[[*ids, *answer]], max_tokens=1, temperature=0, logprobs=1,
                                    echo=True).choices[0].logprobs
    assert len(echoed.token_logprobs) == len(ids) + len(answer) + 1 and echoed.token_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in echoed.token_logprobs[1:])
    scores = echoed.token_logprobs[len(ids):-1]
    said = written.choices[0].logprobs.token_logprobs
    # vLLM's prompt_logprobs: the same scores by token id, ranked (the greedy answer's tokens rank first)
    ranked = api.completions.create(model=model, prompt=[[*ids, *answer]], max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 1}).choices[0].model_extra["prompt_logprobs"]
    assert ranked[0] is None and len(ranked) == len(ids) + len(answer)
    mine = [entry[str(token)] for entry, token in zip(ranked[1:], [*ids, *answer][1:])]
    assert [m["logprob"] for m in mine] == echoed.token_logprobs[1:-1]
    assert all(m["rank"] == 1 for m in mine[len(ids) - 1:]) and max(m["rank"] for m in mine) > 1
    fixed = all(w.info.prefix_cache.generated for w in shared_client.info().target_workers)
    # Rows fixed by position (packed weights, as on a CPU with native bf16): bitwise. Else a prompt row rounds
    # otherwise than a decoded one (the module's tolerance).
    assert scores == (said if fixed else pytest.approx(said, abs=ONE_PASS_TOLERANCE))
    if fixed:
        tops = echoed.top_logprobs[len(ids):-1]
        assert all(lp == max(top.values()) for lp, top in zip(scores, tops))  # the harness's "greedy"
        # The same text scored again (a harness's next answer after the same context) starts on the blocks whose
        # scores the first one kept: the same scores, bitwise.
        again = api.completions.create(model=model, prompt=[[*ids, *answer]], max_tokens=1, temperature=0,
                                       logprobs=1, echo=True)
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert again.choices[0].logprobs.token_logprobs == echoed.token_logprobs
        from tests.integration.test_services import summed_metric

        kept = summed_metric(shared_cluster.workers("target"), "tandem_target_prompt_score_blocks")
        assert kept["tandem_target_prompt_score_blocks"] >= len(ids) // 16  # SmolLM2's cluster: 16-token blocks
        from tests.integration.test_shared_cache_services import wait_for

        # the coordinator's Info shows the workers as its last poll saw them (every second)
        wait_for(lambda: sum(w.info.prompt_score_blocks for w in shared_client.info().target_workers) >= len(ids) // 16)


def test_the_responses_api_answers_as_chat_completions_do(api, model):
    """A Responses request is the chat completion it asks for: the same greedy text through the real workers,
    whole and as typed events, and the same log-probabilities when asked."""
    messages = [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": PROMPTS[1]}]
    chat_reply = api.chat.completions.create(model=model, messages=messages, max_tokens=MAX_NEW_TOKENS,
                                             temperature=0, logprobs=True, top_logprobs=3).choices[0]
    chat_text = chat_reply.message.content
    reply = api.responses.create(model=model, instructions=messages[0]["content"], input=PROMPTS[1],
                                 max_output_tokens=MAX_NEW_TOKENS, temperature=0, top_logprobs=3,
                                 include=["message.output_text.logprobs"])
    assert reply.output_text == chat_text and reply.status in ("completed", "incomplete")
    scored, chat_scored = reply.output[0].content[0].logprobs, chat_reply.logprobs.content
    assert [(lp.token, [top.token for top in lp.top_logprobs]) for lp in scored] == [
        (lp.token, [top.token for top in lp.top_logprobs]) for lp in chat_scored]
    # within rounding: the two requests' rounds may verify their tokens in batches of other shapes
    assert [lp.logprob for lp in scored] == pytest.approx([lp.logprob for lp in chat_scored], abs=1e-4)
    events = list(api.responses.create(model=model, instructions=messages[0]["content"], input=PROMPTS[1],
                                       max_output_tokens=MAX_NEW_TOKENS, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat_text
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.output_tokens == reply.usage.output_tokens


def test_min_tokens_writes_past_the_models_first_end_as_target_only_does(api, model, smollm2_dir):
    """vLLM's min_tokens through the real workers: a short answer held past its end token, equal to target-only
    decoding with the same stop tokens held back (each verified row masked for its own position)."""
    from tandem.config import ModelConfig
    from tandem.sampling_params import SamplingParams
    from tandem.tokenizer import load_tokenizer, stop_token_ids
    from tests.references import target_only

    tokenizer = load_tokenizer(smollm2_dir)
    question = "Say hi."
    longest = 2 * MAX_NEW_TOKENS
    free = chat(api, model, question, max_tokens=longest, temperature=0)
    assert free.choices[0].finish_reason == "stop"  # it ends on its own
    least = free.usage.completion_tokens + 8
    assert least < longest
    stops = tuple(sorted(stop_token_ids(smollm2_dir, tokenizer, ModelConfig.from_dir(smollm2_dir))))
    held = SamplingParams(min_tokens=least, min_tokens_stop_ids=stops)
    expected = target_only(smollm2_dir, [question], dtype=SHARED_DTYPE, max_new_tokens=longest, sampling=held)[question]
    reply = chat(api, model, question, max_tokens=longest, temperature=0, extra_body={"min_tokens": least})
    assert reply.usage.completion_tokens >= least
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)


def test_a_request_past_the_context_is_the_clients_context_length_error(api, model):
    """What the official client raises for an overflow, and what OpenAI's own API answers: BadRequestError with code
    ``context_length_exceeded`` and "This model's maximum context length is N tokens" (N: /v1/models' max_model_len),
    the sentence LiteLLM and agent frameworks match to trim a conversation or fall back to a larger model."""
    [card] = api.models.list().data
    context = card.model_extra["max_model_len"]
    sentence = f"this model's maximum context length is {context} tokens"
    with pytest.raises(openai.BadRequestError) as refused:  # a prompt that fills the context
        api.completions.create(model=model, prompt=[42] * context, max_tokens=1)
    assert refused.value.code == "context_length_exceeded" and sentence in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:  # room for the prompt, not for the answer asked for
        chat(api, model, "Hi", max_tokens=context)
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "max_tokens"
    assert sentence in refused.value.message
    assert chat(api, model, "Hi", max_tokens=2).usage.completion_tokens <= 2  # nothing was held back
