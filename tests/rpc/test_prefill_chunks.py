"""How much of a long prompt a step computes (tandem/rpc/prefill_chunks.py): sized from measured costs, cut to
prompt attention's pieces."""

from __future__ import annotations

import pytest

from tandem.attention.sdpa import PIECE
from tandem.cost_fit import ForwardCostFit, PromptTokenCost
from tandem.rpc.prefill_chunks import (
    AUTO_STEP_FRACTION,
    LONE_CHUNK_S,
    LONE_OVERHEAD,
    UNFITTED_CHUNK_TOKENS,
    PrefillChunks,
)


def measured(base_s: float, prompt_token_s: float) -> tuple[ForwardCostFit, PromptTokenCost]:
    """Cost estimates as an engine's passes leave them: small steps of ``base_s``, one long prefill."""
    fit, prompt = ForwardCostFit(), PromptTokenCost()
    for tokens in (1, 8, 1, 8):
        fit.observe(tokens, base_s)  # flat: the weights read once dominate small steps
    prompt.observe(400, 400 * prompt_token_s)  # a prefill: what it cost beyond the fitted base
    return fit, prompt


def test_auto_size_is_a_fraction_of_a_step_in_prompt_tokens():
    fit, prompt = measured(0.2, 0.015)  # a 2-core CPU: a prompt token costs 7.5% of a step
    assert prompt.per_token_s == pytest.approx(0.015)
    assert PrefillChunks(None, fit, prompt).size() == int(AUTO_STEP_FRACTION * 0.2 / 0.015)
    fit, prompt = measured(0.01, 0.000002)  # a GPU: prompt tokens nearly free beside reading the weights
    assert PrefillChunks(None, fit, prompt).size() == 2048
    assert PrefillChunks(None, ForwardCostFit(), PromptTokenCost()).size() == UNFITTED_CHUNK_TOKENS
    assert PrefillChunks(0, fit, prompt).size() == 0 and not PrefillChunks(0, fit, prompt).enabled


def test_only_passes_with_prompt_tokens_price_them():
    prompt = PromptTokenCost()
    prompt.observe(0, 1.0)
    assert not prompt.ready and prompt.per_token_s == 0.0
    prompt.observe(prompt.min_tokens - 1, 1.0)  # a short pass gives the fixed part, once a token has a price
    assert not prompt.ready and prompt.fixed_s == 0.0


def test_the_size_follows_what_chunks_cost_deep_into_a_long_prompt():
    fit, prompt = measured(0.2, 0.015)
    chunks = PrefillChunks(None, fit, prompt)
    early = chunks.size()
    for _ in range(30):  # chunks far into a long prompt: attention over more keys, 0.06 s fixed per chunk
        n = chunks.size()
        prompt.observe(n, 0.06 + 0.015 * n)
    assert prompt.fixed_s == pytest.approx(0.06)
    late = chunks.size()
    # The largest chunk that adds at most AUTO_STEP_FRACTION of a step: 0.06 + 0.015 n <= 0.8 * 0.2.
    assert late < early and late == int((AUTO_STEP_FRACTION * 0.2 - 0.06) / 0.015)
    for _ in range(30):  # a fixed part above the whole allowance: a token a step, never none
        prompt.observe(chunks.size(), 0.5)
    assert chunks.size() == 1


@pytest.mark.parametrize("size", [1, 3, 5, 16, 20, 40])
def test_chunks_end_on_piece_boundaries_and_cover_the_prompt(size):
    chunks = PrefillChunks(size, ForwardCostFit(), PromptTokenCost())
    for start in (0, 5, 16, 37):
        pos, end, cuts = start, start + 150, []
        while pos < end:
            n = chunks.take(end - pos, pos)
            assert 0 < n <= max(size, 1)
            cuts.append(n)
            pos += n
        assert pos == end
        last = len(cuts) - 1
        for i, n in enumerate(cuts[:last]):  # every chunk but the last lies in one piece, or ends on a boundary
            first = start + sum(cuts[:i])
            assert (first + n) % PIECE == 0 or (first // PIECE == (first + n - 1) // PIECE), (start, cuts)


def test_the_rest_of_a_prompt_shorter_than_a_chunk_goes_whole():
    chunks = PrefillChunks(20, ForwardCostFit(), PromptTokenCost())
    assert chunks.take(7, 3) == 7
    assert chunks.take(20, 0) == 20
    assert chunks.take(21, 0) == 20  # a multiple of a piece
    assert chunks.take(21, 1) == PIECE - 1  # first back onto a piece's boundary
    assert PrefillChunks(7, ForwardCostFit(), PromptTokenCost()).take(50, 8) == 4  # chunks of 4 tile pieces of 4
    assert PrefillChunks(0, ForwardCostFit(), PromptTokenCost()).take(500, 0) == 500  # chunking off


def test_a_lone_prompt_takes_chunks_that_cost_it_little_and_a_newcomer_no_long_wait():
    fit, prompt = measured(0.2, 0.015)  # a 2-core CPU
    chunks = PrefillChunks(None, fit, prompt)
    # The smallest chunk whose one extra pass (the weights read again) costs at most LONE_OVERHEAD of its tokens.
    assert chunks.lone_size() == int(0.2 / LONE_OVERHEAD / 0.015) > chunks.size()
    assert chunks.take(5000, 0, lone=True) == chunks.lone_size() // PIECE * PIECE
    assert (5 + chunks.take(5000, 5, lone=True)) % PIECE == 0  # ends on a piece's boundary, in one pass
    assert chunks.take(100, 0, lone=True) == 100  # a prompt shorter than a lone chunk goes whole
    fit, prompt = measured(0.01, 0.000002)  # a GPU: a chunk is at least LONE_CHUNK_S of prompt tokens
    assert PrefillChunks(None, fit, prompt).lone_size() == int(LONE_CHUNK_S / 0.000002)
    assert PrefillChunks(None, fit, prompt).take(100_000, 0, lone=True) == 100_000
    # Never below the chunk beside running streams; whole while no prompt token is priced, or chunking is off.
    assert PrefillChunks(4096, fit, prompt).lone_size() == int(LONE_CHUNK_S / 0.000002)
    assert PrefillChunks(10**6, fit, prompt).lone_size() == 10**6
    assert PrefillChunks(None, ForwardCostFit(), PromptTokenCost()).lone_size() is None
    assert PrefillChunks(None, ForwardCostFit(), PromptTokenCost()).take(5000, 0, lone=True) == 5000
    assert PrefillChunks(0, fit, prompt).lone_size() is None


def test_prompts_arriving_together_share_one_lone_chunk_and_finish_oldest_first():
    """Fifteen 2,000-token prompts arriving at an idle worker, cut a lone chunk each, made one step of 30,000 tokens."""
    fit, prompt = measured(0.2, 0.015)  # a 2-core CPU: a lone chunk is 266 tokens, one beside streams 10
    chunks = PrefillChunks(None, fit, prompt)
    lone, size = chunks.lone_size(), chunks.size()
    assert (lone, size) == (266, 10)
    # none fits whole: the oldest takes a lone chunk, the others one beside it, so the oldest finishes first
    cuts = chunks.take_lone([(2000, 0)] * 15)
    assert cuts[0] == chunks.take(2000, 0, lone=True) and cuts[1:] == [8] * 14  # (8: 10 cut to attention's pieces)
    assert sum(cuts) <= lone + 14 * size
    # those that fit in it finish now, shortest first, and the others wait with small chunks (a newcomer's first
    # token is not held up by a long prompt's lone chunk)
    assert chunks.take_lone([(2000, 64), (30, 0), (200, 0), (100, 0)]) == [8, 30, 8, 100]  # 30 + 100 fit, 200 not
    assert chunks.take_lone([(100, 0), (100, 0), (100, 0)]) == [100, 100, 8]
    # alone, as before: a lone chunk, or the whole rest where it fits
    assert chunks.take_lone([(5000, 0)]) == [chunks.take(5000, 0, lone=True)]
    assert chunks.take_lone([(100, 0)]) == [100]
    # unpriced, or chunking off: whole
    assert PrefillChunks(None, ForwardCostFit(), PromptTokenCost()).take_lone([(5000, 0), (3000, 0)]) == [5000, 3000]
    assert PrefillChunks(0, fit, prompt).take_lone([(5000, 0)]) == [5000]
