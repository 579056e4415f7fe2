"""Structured output on a real model and real text: the text is valid JSON under the schema, and every
speculative method gives constrained target-only decoding's text (greedy) and its seeded draws (sampled)."""

from __future__ import annotations

import json

import pytest

from tandem.sampling_params import SamplingParams
from tests.spec.test_greedy_equivalence import load

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                          "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age", "languages"], "additionalProperties": False}
QUESTION = "Describe a made-up programmer as JSON: a name, an age and the languages they use."


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from tandem.structured_output import StructuredOutput
    from tandem.tokenizer import encode_prompt, load_tokenizer, stop_token_ids

    tokenizer = load_tokenizer(smollm2_dir)
    engine = load(smollm2_dir)
    structured = StructuredOutput(smollm2_dir, engine.config)
    stops = frozenset(stop_token_ids(smollm2_dir, tokenizer, engine.config))
    return engine, structured, tokenizer, encode_prompt(tokenizer, QUESTION, chat=True), stops


@pytest.fixture(scope="module")
def same_model_draft(smollm2_dir):
    """SmolLM2 drafting for itself: its proposals are the target's unconstrained choices, so the grammar keeps long
    accepted runs where they are valid and cuts them where they are not."""
    return load(smollm2_dir)


def generate(smollm2, sampling: SamplingParams, method: str = "none", draft=None, n: int = 96,
             question: str | None = None, **options) -> list[int]:
    """The answer's token ids; a constrained one must end (a complete JSON value, then the stop token)."""
    from tandem.inprocess import GenerationRequest, SpeculativeGenerator
    from tandem.spec.options import SpecOptions

    engine, structured, tokenizer, prompt, stops = smollm2
    if question is not None:
        from tandem.tokenizer import encode_prompt

        prompt = encode_prompt(tokenizer, question, chat=True)
    generator = SpeculativeGenerator(engine, draft, SpecOptions(method, options.pop("k_max", 0), False, **options),
                                     structured=structured)
    (result,) = generator.generate([GenerationRequest(prompt, n, sampling, stops)])
    assert result.finish_reason == "stop" or not sampling.structured, f"the JSON value did not end within {n} tokens"
    return result.token_ids


def text_of(smollm2, ids: list[int]) -> str:
    return smollm2[2].decode(ids, skip_special_tokens=True)


def test_json_schema_output_is_valid_and_speculation_keeps_it(smollm2, same_model_draft):
    constrained = SamplingParams(json_schema=json.dumps(PERSON))
    alone = generate(smollm2, constrained)
    person = json.loads(text_of(smollm2, alone))
    assert set(person) == {"name", "age", "languages"} and isinstance(person["age"], int) and person["age"] >= 0
    assert all(isinstance(x, str) for x in person["languages"]) and len(person["languages"]) <= 3
    free = text_of(smollm2, generate(smollm2, SamplingParams(), n=16))
    assert not free.lstrip().startswith(("{", "```")), free  # unconstrained, it answers in prose
    # Chains and a tree from a draft model, and n-gram chains (mostly rejected). Early exit, whose drafts SmolLM2
    # rejects about 19 times in 20 (22 of this test's 43 s), is constrained in the seeded test below.
    for method, draft, tree in (("draft", same_model_draft, "off"), ("ngram", None, "off"),
                                ("draft", same_model_draft, "on")):
        assert generate(smollm2, constrained, method, draft, k_max=4, ngram_max=3, tree=tree) == alone, (method, tree)


def test_json_object_output_is_an_object(smollm2):
    answer = generate(smollm2, SamplingParams(json_object=True), question="Give the width and height of a 3 by 4 "
                      "rectangle as a JSON object.")
    assert json.loads(text_of(smollm2, answer)) == {"width": 3, "height": 4}


def test_seeded_constrained_sampling_is_plain_seeded_decoding(smollm2):
    from draft_worker.engine import early_exit_engine

    sampling = SamplingParams(temperature=0.9, seed=4, json_schema=json.dumps(PERSON))
    alone = generate(smollm2, sampling)
    assert set(json.loads(text_of(smollm2, alone))) == {"name", "age", "languages"}
    drafted = generate(smollm2, sampling, "early-exit", early_exit_engine(smollm2[0], 20), k_max=4)
    assert drafted == alone
