"""vLLM's structured outputs on the HTTP API: ``structured_outputs`` ({json | regex | choice | grammar |
json_object}) and the older ``guided_*`` fields, each reaching the target worker as the request's constraint,
over the scripted target (tests/http/harness.py). What the target does with them: tests/test_structured_output.py
and the shared cluster's test (tests/integration/test_http_openai.py)."""

from __future__ import annotations

import json

import pytest

from tandem.structured_output import choice_grammar, regex_grammar
from tests.coordinator.inprocess import tiny_tokenizer
from tests.http.harness import http_coordinator
from tests.http.test_http_api import CHAT, post, run

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
LARK = 'start: "yes" | "no"'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.mark.parametrize("fields,want", [
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"grammar": choice_grammar(["yes", "no"])}),
    ({"guided_choice": ["yes", "no"]}, {"grammar": choice_grammar(["yes", "no"])}),
    ({"structured_outputs": {"regex": r"\d{3}"}}, {"grammar": regex_grammar(r"\d{3}")}),
    ({"guided_regex": r"\d{3}"}, {"grammar": regex_grammar(r"\d{3}")}),
    ({"structured_outputs": {"grammar": LARK}}, {"grammar": LARK}),
    ({"guided_grammar": LARK}, {"grammar": LARK}),
    ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": SCHEMA}),
    ({"guided_json": json.dumps(SCHEMA)}, {"json_schema": SCHEMA}),
    ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
    ({"structured_outputs": {"json_object": False}}, {}),
])
@pytest.mark.parametrize("route", ["/chat/completions", "/completions"])
def test_each_form_reaches_the_target_as_its_constraint(tokenizer, fields, want, route):
    async def go():
        async with http_coordinator(tokenizer) as running:
            body = {**CHAT, **fields} if route == "/chat/completions" else {"prompt": "hi", "max_tokens": 2, **fields}
            code, reply = await post(running.url + route, body)
            assert code == 200, reply
            [sampling] = running.target.samplings
            assert sampling.grammar == want.get("grammar", "")
            assert (json.loads(sampling.json_schema) if sampling.json_schema else None) == want.get("json_schema")
            assert sampling.json_object == want.get("json_object", False)
    run(go())


@pytest.mark.parametrize("fields,param,message", [
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs.choice", "one structured-output"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "one structured-output"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
     "structured_outputs.choice", "not both"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "a non-empty list"),
    ({"guided_choice": "yes"}, "guided_choice", "a list of strings"),
    ({"structured_outputs": {"regex": 3}}, "structured_outputs.regex", "a regular expression"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "cannot be enforced"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar", "cannot be enforced"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"structured_outputs": {"json": {"type": "color"}}}, "structured_outputs.json", "Invalid type"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "true or false"),
    ({"structured_outputs": {"backend": "xgrammar"}}, "structured_outputs.backend", "unknown field"),
])
def test_bad_constraints_are_400_naming_the_field_before_any_worker(tokenizer, fields, param, message):
    async def go():
        async with http_coordinator(tokenizer) as running:
            code, reply = await post(running.url + "/chat/completions", {**CHAT, **fields})
            assert code == 400 and reply["error"]["param"] == param, reply
            assert message in reply["error"]["message"], reply
            assert not running.target.calls["Prefill"]
    run(go())
