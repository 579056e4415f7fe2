"""Speculative sampling with penalties and a logit bias is lossless, chains and trees, and the test can tell
when it is not.

Through the engines as in ``test_lossless`` (the draft's q on the wire, decoded by the target): output
tokens 2 and 3 of many seeded runs must follow the target's own two-token law, computed exactly with the
penalties applied after each context (an independent reference, row by row), with the unrelated draft
(most drafts rejected: the residuals) and with the target drafting for itself (most kept).

The defect: every row adjusted for the committed text only, blind to the drafts on its path. With the
target as its own draft, token 2 is a kept draft and token 3 is decided at the row after it, so the
defect draws token 3 as if token 2 had not been said. Prompt and penalties were chosen, by computing
both laws exactly, where that moves the law of (t2, t3) by a chi-square noncentrality of about 14,000
at 500 samples: the defect cannot pass.
"""

from __future__ import annotations

import pytest
import torch

from tandem.sampling_params import SamplingParams
from target_worker.engine import TargetEngine
from tests.draft_worker.test_lossless import load
from tests.spec.losslessness import (
    PAIR_SAMPLES,
    PAIR_TEMPERATURE,
    PAIR_VOCAB,
    PER_ROW_DRAFTERS,
    SIGNIFICANCE,
    per_row_pvalue,
    save_six_token_pair,
)

PROMPT, VOCAB = [3, 3, 4], PAIR_VOCAB
REPETITION, FREQUENCY, PRESENCE, BIAS = 1.5, 1.0, 1.0, ((2, 0.3),)


@pytest.fixture(scope="module")
def six_token_pair(tmp_path_factory):
    return save_six_token_pair(tmp_path_factory.mktemp("pair"))


def params(seed: int) -> SamplingParams:
    return SamplingParams(PAIR_TEMPERATURE, seed=seed, rejection_rule=True, repetition_penalty=REPETITION,
                          frequency_penalty=FREQUENCY, presence_penalty=PRESENCE, logit_bias=BIAS)


def reference(logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
    """The penalties as OpenAI and vLLM define them, one token at a time, for one ``[vocab]`` row."""
    out = logits.double().clone()
    for token, bias in BIAS:
        out[token] += bias
    for token in range(len(out)):
        count = generated.count(token)
        if count or token in PROMPT:
            out[token] = out[token] / REPETITION if out[token] > 0 else out[token] * REPETITION
        out[token] -= FREQUENCY * count + PRESENCE * (count > 0)
    return out.float()


@pytest.mark.parametrize("n", [PAIR_SAMPLES, pytest.param(4000, marks=pytest.mark.long)], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize(**PER_ROW_DRAFTERS)
def test_penalised_speculative_sampling_follows_the_target(six_token_pair, monkeypatch, tree, drafter, defect,
                                                           lossless, n):
    pvalue = per_row_pvalue(six_token_pair, monkeypatch, drafter, defect, lambda d: TargetEngine(load(d)), PROMPT,
                            params, reference, n, tree)
    assert (pvalue > SIGNIFICANCE) == lossless, f"p-value {pvalue:.2e}"
