"""Structured output's masks: each row masked for its own path, rolled back after, checked on a real (tiny)
tokenizer whose every token is one character, so the grammar's choices can be written down by hand."""

from __future__ import annotations

import pytest
import torch

from tandem.config import ModelConfig
from tandem.errors import InvalidRequestError
from tandem.sampling_params import SamplingParams
from tandem.structured_output import StructuredOutput, apply_masks, check_response_format

# The six-token tokenizer: 0 <s>, 1 </s> (the stop token), 2 "!", 3 '"', 4 "#", 5 <unk>.
EOS, BANG, QUOTE, HASH = 1, 2, 3, 4
# A JSON string of "!" and "#": an opening quote, any of the two, a closing quote, then the stop token.
STRING = SamplingParams(json_schema='{"type": "string", "pattern": "^[!#]*$"}')


@pytest.fixture(scope="module")
def structured(tmp_path_factory):
    from tests.spec.losslessness import save_six_token_pair

    target, _ = save_six_token_pair(tmp_path_factory.mktemp("pair"))
    return StructuredOutput(target, ModelConfig.from_dir(target))


def allowed(bitmask: torch.Tensor) -> list[list[int]]:
    return [[t for t in range(6) if (int(row[0]) & 0xFFFFFFFF) >> t & 1] for row in bitmask]


def test_each_row_is_masked_for_its_own_path_and_the_matcher_rolls_back(structured):
    matcher = structured.matcher(STRING)
    paths = [[], [QUOTE], [QUOTE, BANG], [QUOTE, QUOTE], [QUOTE, HASH, BANG]]
    assert allowed(matcher.masks(paths)) == [[QUOTE], [BANG, QUOTE, HASH], [BANG, QUOTE, HASH], [EOS],
                                             [BANG, QUOTE, HASH]]
    assert matcher.consumed == 0 and allowed(matcher.masks([[]])) == [[QUOTE]]  # every path rolled back


def test_a_row_the_grammar_cannot_reach_is_left_unmasked(structured):
    """Its path holds a token an earlier row masked out: no verdict reaches it, and it must stay a distribution."""
    assert allowed(structured.matcher(STRING).masks([[BANG], [QUOTE, EOS, BANG]])) == [list(range(6))] * 2


def test_commits_and_rollbacks_follow_the_sequence(structured):
    matcher = structured.matcher(STRING, generated=[QUOTE, BANG])  # a rebuild: its generated tokens first
    assert matcher.consumed == 2
    matcher.commit([QUOTE])
    assert allowed(matcher.masks([[]])) == [[EOS]]
    matcher.rollback_to(1)  # a Verify that cut the history back to its first generated token
    assert allowed(matcher.masks([[], [HASH]])) == [[BANG, QUOTE, HASH]] * 2
    matcher.commit([QUOTE, EOS, BANG])  # past the stop token the coordinator cuts the text: no error
    assert matcher.ended and allowed(matcher.masks([[]])) == [list(range(6))]


def test_masked_tokens_get_minus_infinity_on_the_logits_device():
    bitmask = torch.tensor([[0b101], [-1]], dtype=torch.int32)  # row 0: ids 0 and 2; row 1: all
    logits = torch.arange(12, dtype=torch.float32).view(2, 6)
    out = apply_masks(logits, bitmask)
    assert torch.isinf(out[0, [1, 3, 4, 5]]).all() and out[0, [0, 2]].tolist() == [0.0, 2.0]
    assert torch.equal(out[1], logits[1]) and not torch.isinf(logits).any()  # a new tensor
    assert apply_masks(torch.zeros(1, 40, device="meta"), torch.zeros(1, 2, dtype=torch.int32)).is_meta


@pytest.mark.parametrize("fields,named", [
    ({"json_schema": "{not json"}, "json_schema is not JSON"),
    ({"json_schema": "[1, 2]"}, "must be a JSON object"),
    ({"json_object": True, "json_schema": "{}"}, "not both"),
])
def test_bad_formats_are_refused_naming_response_format(fields, named):
    with pytest.raises(InvalidRequestError, match=f"response_format: .*{named}"):
        SamplingParams(**fields)


@pytest.mark.parametrize("schema,named", [('{"type": "color"}', "Invalid type"),
                                          ('{"$ref": "#/definitions/missing"}', "does not exist")])
def test_schemas_the_grammar_cannot_hold_are_refused_before_any_worker(schema, named):
    with pytest.raises(InvalidRequestError, match=f"response_format: .*{named}"):
        check_response_format(SamplingParams(json_schema=schema))
    check_response_format(STRING)  # a good one passes


def test_a_choice_grammar_allows_exactly_its_texts_quotes_included(structured):
    """vLLM's ``choice``: each choice is a string literal of the grammar, escaped (a quote inside one)."""
    from tandem.structured_output import choice_grammar

    matcher = structured.matcher(SamplingParams(grammar=choice_grammar(['!"', "#", "##"])))
    assert allowed(matcher.masks([[], [BANG], [BANG, QUOTE], [HASH], [HASH, HASH]])) == [
        [BANG, HASH], [QUOTE], [EOS], [EOS, HASH], [EOS]]
    with pytest.raises(InvalidRequestError, match="choice: a non-empty list"):
        choice_grammar([])
    with pytest.raises(InvalidRequestError, match="choice: a non-empty list"):
        choice_grammar(["a", ""])


def test_a_regex_grammar_matches_the_whole_text(structured):
    from tandem.structured_output import regex_grammar

    matcher = structured.matcher(SamplingParams(grammar=regex_grammar('!#*"')))  # "/" needs no escape of its own
    assert allowed(matcher.masks([[], [BANG], [BANG, HASH, HASH], [BANG, QUOTE]])) == [
        [BANG], [QUOTE, HASH], [QUOTE, HASH], [EOS]]
    check_response_format(SamplingParams(grammar=regex_grammar("a/b")))
    with pytest.raises(InvalidRequestError, match="grammar: the grammar cannot be enforced"):
        check_response_format(SamplingParams(grammar=regex_grammar("(unclosed")))


def test_a_rebuilt_sequence_resumes_its_grammar_where_it_was(structured):
    """A request moved to another target arrives as its whole history (a rebuild Prefill): the matcher is
    advanced through its generated tokens, so the next token follows the grammar from there."""
    from tandem.config import EngineConfig
    from tandem.engine import ModelEngine
    from target_worker.engine import PrefillCall, TargetEngine, VerifyCall

    engine = ModelEngine.load(EngineConfig(structured.model_dir, dtype="float32", block_size=4))
    target = TargetEngine(engine, structured=structured)
    prompt = [0, 3, 2, 5]
    for generated, allowed_next in (([QUOTE, BANG], {BANG, QUOTE, HASH}), ([QUOTE, HASH, QUOTE], {EOS})):
        for seed in range(8):
            sampling = SamplingParams(1.0, seed=seed, json_schema=STRING.json_schema)
            history = [*prompt, *generated]
            (rebuilt,) = target.run_batch([PrefillCall("s", history, sampling, prompt_len=len(prompt), replace=True)])
            assert not isinstance(rebuilt, BaseException), rebuilt
            (verdict,) = target.run_batch([VerifyCall("s", len(history), [], [])])
            assert verdict.next_token in allowed_next


def test_a_worker_reads_the_tokenizer_at_warmup_and_serves_on_when_it_cannot(tiny_served_dir, structured, caplog):
    """Read at start, not on the first constrained request (2.7 s for Qwen's); one llguidance cannot read (this
    tiny model's Fuse decoder) is logged and the worker warms up, while such requests get the error by name."""
    from tandem.config import EngineConfig
    from tandem.engine import ModelEngine
    from target_worker.engine import PrefillCall, TargetEngine

    structured.prepare()
    assert structured._tokenizer is not None
    engine = ModelEngine.load(EngineConfig(tiny_served_dir, dtype="float32", block_size=4))
    target = TargetEngine(engine, structured=StructuredOutput(tiny_served_dir, engine.config))
    target.warmup()
    assert "structured output cannot read this model's tokenizer" in caplog.text
    (refused,) = target.run_batch([PrefillCall("s", [5, 6, 7], SamplingParams(json_object=True))])
    assert isinstance(refused, InvalidRequestError) and "response_format" in str(refused)
    assert target.num_sequences == 0
