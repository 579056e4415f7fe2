"""Penalties and logit bias: each row adjusted for its own context, checked against references written
independently (transformers' repetition penalty, OpenAI's formula row by row), validated, and carried
over the wire."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from tandem.errors import InvalidRequestError
from tandem.penalties import adjust_logits, row_paths_of
from tandem.rpc.wire import sampling_from_proto, sampling_to_proto
from tandem.sampling_params import SamplingParams, logit_bias_pairs

VOCAB = 12


def reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
              contexts: list[list[int]]) -> torch.Tensor:
    """Row r adjusted for the generated tokens ``contexts[r]``, one token id at a time (vLLM's order)."""
    out = logits.clone().double()
    for r, generated in enumerate(contexts):
        for token, bias in params.logit_bias:
            out[r, token] += bias
        for token in range(out.shape[1]):
            count = generated.count(token)
            if token in prompt or count:
                value = out[r, token]
                out[r, token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
            out[r, token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out.float()


PENALTIES = SamplingParams(0.8, repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=-0.3,
                           logit_bias=logit_bias_pairs({3: 5.0, 11: -2.5}))


@pytest.mark.parametrize("parents", [None, [-1, 0, -1, 2, 0]], ids=["chain", "tree"])
def test_each_row_counts_the_drafts_on_its_own_path(parents):
    prompt, output = [1, 2, 2, 9], [4, 4, 7]
    drafts = [4, 5, 7, 7, 9]
    paths = row_paths_of(drafts, parents)
    if parents is None:
        assert paths == [[], [4], [4, 5], [4, 5, 7], [4, 5, 7, 7], [4, 5, 7, 7, 9]]
    else:  # node 2 hangs on the root, node 3 on node 2, node 4 on node 0
        assert paths == [[], [4], [4, 5], [7], [7, 7], [4, 9]]
    logits = torch.randn(len(paths), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    got = adjust_logits(logits, PENALTIES, frozenset(prompt), output, paths)
    want = reference(logits, PENALTIES, prompt, [output + path for path in paths])
    torch.testing.assert_close(got, want)
    assert not torch.equal(got[0], got[2])  # the rows really differ by their paths (not one row for all)


def test_repetition_penalty_is_transformers_own():
    """The CTRL rule as transformers applies it over the whole input (prompt and generated text)."""
    prompt, output = [0, 5, 5, 6], [8, 6, 2]
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2)) * 4
    params = SamplingParams(repetition_penalty=1.7)
    got = adjust_logits(logits, params, frozenset(prompt), output, [[]])
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(got, want)


def test_frequency_and_presence_count_the_generated_text_only():
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    got = adjust_logits(logits, params, frozenset([3]), [4, 4, 4], [[]])[0]
    assert got[3] == 0  # in the prompt only: not counted
    assert got[4] == pytest.approx(-(3 * 0.5 + 1.0))
    assert torch.count_nonzero(got) == 1


def test_ids_past_a_drafts_vocabulary_are_left_out():
    """A lean draft scores fewer ids than the target: ids it cannot score change nothing, and fail nothing."""
    logits = torch.zeros(2, 6)
    params = SamplingParams(frequency_penalty=1.0, logit_bias=((2, 1.0), (40, 9.0)))
    got = adjust_logits(logits, params, (), [2, 50], [[], [40]])
    assert got[:, 2].tolist() == [0.0, 0.0] and torch.count_nonzero(got) == 0  # +1 bias, -1 for its count


def test_no_penalty_leaves_the_logits_as_they_are():
    logits = torch.randn(3, VOCAB)
    assert not SamplingParams(0.7).adjusts_logits
    assert SamplingParams(logit_bias=((1, 0.5),)).adjusts_logits
    torch.testing.assert_close(adjust_logits(logits, SamplingParams(), (), [1, 2], [[], [3], [3, 4]]), logits)


@pytest.mark.parametrize("fields,named", [
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"logit_bias": ((4, 100.5),)}, "logit_bias of token 4"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias: token id -1"),
    ({"logit_bias": ((5, 1.0), (5, 2.0))}, "logit_bias: token ids must be distinct"),
    ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias holds 301"),
])
def test_bad_values_are_refused_naming_the_field(fields, named):
    with pytest.raises(InvalidRequestError, match=named):
        SamplingParams(**fields)


def test_penalties_cross_the_wire():
    back = sampling_from_proto(sampling_to_proto(PENALTIES))
    assert back.logit_bias == PENALTIES.logit_bias
    assert back.repetition_penalty == pytest.approx(1.4)  # float32 on the wire
    assert (back.frequency_penalty, back.presence_penalty) == pytest.approx((0.7, -0.3))
    assert sampling_from_proto(sampling_to_proto(SamplingParams())) == SamplingParams()  # 0 on the wire: 1


def test_min_tokens_masks_the_stop_tokens_on_rows_before_it():
    """Row r predicts generated position len(output) + len(path r): below min_tokens its stop tokens are -inf."""
    params = SamplingParams(min_tokens=3, min_tokens_stop_ids=(2, 5, 99))  # 99: past this vocabulary, left out
    assert params.adjusts_logits and not SamplingParams(min_tokens=3).adjusts_logits
    logits = torch.randn(4, VOCAB)
    out = adjust_logits(logits, params, frozenset(), [7], [[], [1], [1, 4], [1, 4, 6]])  # positions 1, 2, 3, 4
    assert torch.isinf(out[:2, [2, 5]]).all() and (out[:2, [2, 5]] < 0).all()
    assert torch.equal(out[2:], logits[2:]) and torch.equal(out[:2, [0, 1, 3]], logits[:2, [0, 1, 3]])
    msg = sampling_to_proto(params)
    assert sampling_from_proto(msg) == params and msg.min_tokens == 3
    with pytest.raises(InvalidRequestError, match="min_tokens must be >= 0"):
        SamplingParams(min_tokens=-1)


def test_allowed_token_ids_leave_every_other_token_at_minus_infinity():
    logits = torch.randn(3, VOCAB)
    params = SamplingParams(allowed_token_ids=(2, 5, 7), logit_bias=logit_bias_pairs({5: 1.5, 9: 4.0}))
    assert params.adjusts_logits
    out = adjust_logits(logits, params, frozenset(), [], [[], [2], [2, 5]])
    others = [t for t in range(VOCAB) if t not in (2, 5, 7)]
    assert torch.isinf(out[:, others]).all() and (out[:, others] < 0).all()  # a bias brings none of them back
    assert torch.equal(out[:, [2, 7]], logits[:, [2, 7]]) and torch.allclose(out[:, 5], logits[:, 5] + 1.5)
    # A draft whose vocabulary holds none of them proposes unmasked (never a row of -inf alone).
    assert torch.equal(adjust_logits(logits[:, :2], SamplingParams(allowed_token_ids=(5,)), frozenset(), [],
                                     [[], [], []]), logits[:, :2])
    assert sampling_from_proto(sampling_to_proto(params)) == params


@pytest.mark.parametrize("fields,named", [
    ({"allowed_token_ids": (5, 3)}, "distinct and ascending"),
    ({"allowed_token_ids": (-1, 3)}, "must be >= 0"),
    ({"allowed_token_ids": (3,), "json_object": True}, "not with a response format"),
    ({"allowed_token_ids": (1,), "min_tokens": 2, "min_tokens_stop_ids": (1,)}, "only stop tokens"),
])
def test_allowed_token_ids_that_leave_nothing_or_are_malformed_are_refused(fields, named):
    with pytest.raises(InvalidRequestError, match=f"allowed_token_ids: .*{named}"):
        SamplingParams(**fields)


@pytest.mark.parametrize("parents", [None, [-1, 0, -1, 2, 0]], ids=["chain", "tree"])
def test_bad_words_ban_a_words_end_on_rows_whose_text_ends_with_its_start(parents):
    """vLLM's bad_words: a one-token word everywhere; a longer word's last token where the row's generated text
    (the committed output, then the row's own path) ends with the word's other tokens."""
    words = ((4,), (1, 2, 3), (6, 7), (2, 9))
    output, drafts = [5, 1], [2, 6, 2, 1, 6]
    paths = row_paths_of(drafts, parents)
    logits = torch.randn(len(paths), VOCAB)
    out = adjust_logits(logits, SamplingParams(bad_word_ids=words), frozenset([6]), output, paths)
    for r, path in enumerate(paths):
        text = [*output, *path]
        banned = {w[-1] for w in words if text[len(text) - len(w) + 1:] == list(w[:-1]) or len(w) == 1}
        for token in range(VOCAB):
            assert torch.isinf(out[r, token]) == (token in banned), (r, path, token)
    # A word whose head is in the prompt only is not matched there (the generated text alone counts, as vLLM's).
    assert not torch.isinf(adjust_logits(logits[:1], SamplingParams(bad_word_ids=((6, 7),)), frozenset([6]), [],
                                         [[]])).any()
    params = SamplingParams(bad_word_ids=words)
    assert sampling_from_proto(sampling_to_proto(params)) == params
    with pytest.raises(InvalidRequestError, match="bad_words: each word needs"):
        SamplingParams(bad_word_ids=((),))
