"""Tokens a grammar forces are proposed as the next round (``GRAMMAR``) and kept, for every method but plain
decoding, and output stays constrained target-only decoding's (greedy) and plain seeded decoding's (sampled).

The six-token pair (tests/spec/losslessness.py): ids 2 "!", 3 '"', 4 "#" are single characters, 1 the stop
token, so a grammar's forced text is written down by hand.
"""

from __future__ import annotations

import pytest

from tandem.sampling_params import SamplingParams

EOS, BANG, QUOTE, HASH = 1, 2, 3, 4
RUN = [BANG, HASH, BANG, HASH, BANG]  # what the grammars below force, somewhere
# The first five forced: the Prefill's token is the first, its reply lists the other four.
FORCED_FIRST = SamplingParams(grammar='start: "!#!#!" /[!#]*/')
# After the first token (free, the Prefill's), five forced ones, all in the Prefill's reply; then free again.
FORCED_SECOND = SamplingParams(grammar='start: /[!#]/ "!#!#!" /[!#]*/')
# After three free tokens: the forced run starts after a Verify (its first token the Verify's own, or not).
FORCED_LATER = SamplingParams(grammar='start: /[!#]/ /[!#]/ /[!#]/ "!#!#!" /[!#]*/')


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from tandem.config import EngineConfig, ModelConfig
    from tandem.engine import ModelEngine
    from tandem.structured_output import StructuredOutput
    from tests.spec.losslessness import save_six_token_pair

    target_dir, draft_dir = save_six_token_pair(tmp_path_factory.mktemp("forced"))
    target, draft = (ModelEngine.load(EngineConfig(d, dtype="float32", block_size=4)) for d in (target_dir, draft_dir))
    return target, draft, StructuredOutput(target_dir, ModelConfig.from_dir(target_dir))


def generate(pair, sampling: SamplingParams, method: str = "none", k: int = 0):
    from tandem.inprocess import GenerationRequest, SpeculativeGenerator
    from tandem.spec.options import SpecOptions

    target, draft, structured = pair
    generator = SpeculativeGenerator(target, draft if method in ("draft", "hybrid") else None,
                                     SpecOptions(method, k, False), structured=structured)
    (result,) = generator.generate([GenerationRequest([0, 3, 2, 5], 16, sampling, frozenset({EOS}))])
    return result


@pytest.mark.parametrize("grammar,start,forced", [(FORCED_FIRST, 0, {4}), (FORCED_SECOND, 1, {5}),
                                                   (FORCED_LATER, 3, {4, 5})], ids=["first", "second", "later"])
@pytest.mark.parametrize("method", ["ngram", "draft", "hybrid"])
def test_forced_tokens_are_proposed_whole_and_kept_and_greedy_output_is_unchanged(pair, grammar, start, forced,
                                                                                    method):
    alone = generate(pair, grammar)
    assert alone.token_ids[start:start + 5] == RUN and alone.stats.forced_tokens == 0
    spec = generate(pair, grammar, method, k=2)
    assert spec.token_ids == alone.token_ids
    # the run (or its last four, where the target's own token began it) in one round though k is 2, all kept
    assert spec.stats.forced_tokens in forced and spec.stats.k_counts[spec.stats.forced_tokens] == 1


def test_a_free_request_gets_no_forced_proposals(pair):
    free = generate(pair, SamplingParams(), "ngram", k=2)
    assert free.stats.forced_tokens == 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampling_with_forced_rounds_is_plain_seeded_decoding(pair, method):
    for seed in range(4):
        sampled = SamplingParams(temperature=1.0, seed=seed, grammar=FORCED_SECOND.grammar)
        alone = generate(pair, sampled)
        spec = generate(pair, sampled, method, k=2)
        assert spec.token_ids == alone.token_ids and spec.stats.forced_tokens == 5


def test_the_matcher_lists_what_the_grammar_forces(pair):
    structured = pair[2]
    matcher = structured.matcher(FORCED_FIRST)
    assert matcher.forced(8) == [BANG, HASH, BANG, HASH, BANG] and matcher.forced(2) == [BANG, HASH]
    matcher.commit([BANG, HASH])
    assert matcher.forced(8) == [BANG, HASH, BANG] and matcher.forced(0) == []
    matcher.commit([BANG, HASH, BANG])
    assert matcher.forced(8) == []  # free: "!", "#" or the end
    assert structured.matcher(FORCED_SECOND).forced(8) == []
