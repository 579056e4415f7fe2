"""Speculative sampling under a JSON schema is lossless, chains and trees, and the test can tell when it is not.

The six-token pair of ``tests.spec.losslessness``, whose tokenizer spells one character per token: the
schema asks for a JSON string of "!" and "#", so the text is an opening quote, any of the two, a closing
quote, then the stop token. Output tokens 2 and 3 of many seeded runs must follow the target's own law
under that grammar, computed exactly with the allowed tokens written down by hand (not by the code under
test). The drafts are not constrained: an unrelated draft, and the target drafting for itself.

The defect: every row masked for the committed text only, blind to the drafts on its path. Token 1 is
the opening quote; when token 2 is a drafted closing quote, the defect lets token 3 be a character where
only the stop token may follow: an outcome of probability 0. A logit bias towards the quote (both sides
apply it) makes that case common, so the defect fails with p = 0 at 500 samples; without the bias it
failed with p = 4e-5 (chain) and 2e-7 (tree), too close to call.
"""

from __future__ import annotations

import pytest
import torch

from tandem.config import ModelConfig
from tandem.sampling_params import SamplingParams
from tandem.structured_output import StructuredOutput
from target_worker.engine import TargetEngine
from tests.draft_worker.test_lossless import load
from tests.spec.losslessness import (
    PAIR_PROMPT,
    PAIR_SAMPLES,
    PAIR_TEMPERATURE,
    PER_ROW_DRAFTERS,
    SIGNIFICANCE,
    per_row_pvalue,
    save_six_token_pair,
)

EOS, BANG, QUOTE, HASH = 1, 2, 3, 4  # the tokenizer's stop token and three of its characters
SCHEMA = '{"type": "string", "pattern": "^[!#]*$"}'


@pytest.fixture(scope="module")
def six_token_pair(tmp_path_factory):
    return save_six_token_pair(tmp_path_factory.mktemp("pair"))


# A bias towards the quote, so that a closing quote is often drafted and kept (with the grammar on top of a
# bias, as a request may ask for both): where the defect shows.
QUOTE_BIAS = 2.0


def params(seed: int) -> SamplingParams:
    return SamplingParams(PAIR_TEMPERATURE, seed=seed, rejection_rule=True, json_schema=SCHEMA,
                          logit_bias=((QUOTE, QUOTE_BIAS),))


def allowed_after(generated: list[int]) -> list[int]:
    """The grammar by hand: a quote opens the string, "!" and "#" go inside, a second quote closes it."""
    if not generated:
        return [QUOTE]
    return [EOS] if generated.count(QUOTE) == 2 else [BANG, QUOTE, HASH]


def reference(logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
    """The bias, then every token the grammar refuses at -inf."""
    biased = logits.clone()
    biased[QUOTE] += QUOTE_BIAS
    masked = torch.full_like(logits, float("-inf"))
    keep = allowed_after(generated)
    masked[keep] = biased[keep]
    return masked


@pytest.mark.parametrize("n", [PAIR_SAMPLES, pytest.param(4000, marks=pytest.mark.long)], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize(**PER_ROW_DRAFTERS)
def test_constrained_speculative_sampling_follows_the_target(six_token_pair, monkeypatch, tree, drafter, defect,
                                                             lossless, n):
    def target(model_dir):
        return TargetEngine(load(model_dir), structured=StructuredOutput(model_dir, ModelConfig.from_dir(model_dir)))

    pvalue = per_row_pvalue(six_token_pair, monkeypatch, drafter, defect, target, PAIR_PROMPT, params, reference, n,
                            tree)
    assert (pvalue > SIGNIFICANCE) == lossless, f"p-value {pvalue:.2e}"
