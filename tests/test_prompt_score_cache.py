"""Prompt tokens' scores kept by block (``tandem.prompt_score_cache``): which blocks a lookup finds, what it returns."""

from __future__ import annotations

import pytest

from tandem.prompt_score_cache import PromptScoreCache
from tandem.spec.transport import TokenLogprob

BS = 4
TOKENS = list(range(10, 24))  # 14 tokens: three full blocks and two left over


def score(token: int) -> TokenLogprob:
    """A recognisable score of ``token`` (its id as the log-probability)."""
    return TokenLogprob(-float(token), [token], [-float(token)])


def scores_of(tokens: list[int]) -> list[TokenLogprob]:
    return [score(t) for t in tokens[1:]]  # token 0 has none


def test_a_lookup_returns_the_scores_of_tokens_1_to_r_minus_1_of_the_kept_blocks_it_starts_with():
    cache = PromptScoreCache(BS, b"salt", capacity_blocks=16)
    cache.store(TOKENS, 2, scores_of(TOKENS))
    assert len(cache) == 3  # the two tokens after the last full block are not kept
    assert cache.lookup(TOKENS, 2, len(TOKENS)) == scores_of(TOKENS)[:11]
    assert cache.lookup(TOKENS, 2, 9) == scores_of(TOKENS)[:7]  # at most limit tokens: two blocks
    branch = [*TOKENS[:6], 99, 98, 97, 96]  # the second block differs: the first one only
    assert cache.lookup(branch, 2, len(branch)) == scores_of(TOKENS)[:3]
    assert cache.lookup(TOKENS, 3, len(TOKENS)) == []  # another top count
    assert PromptScoreCache(BS, b"other", 16).lookup(TOKENS, 2, len(TOKENS)) == []


def test_scores_that_stop_inside_a_block_keep_only_the_blocks_they_cover():
    cache = PromptScoreCache(BS, b"", capacity_blocks=16)
    cache.store(TOKENS, 0, scores_of(TOKENS)[:8])  # tokens 1..8: blocks 0 and 1 (block 2 needs token 11's)
    assert len(cache) == 2
    assert cache.lookup(TOKENS, 0, len(TOKENS)) == scores_of(TOKENS)[:7]


def test_the_least_recently_used_blocks_go_first():
    cache = PromptScoreCache(BS, b"", capacity_blocks=3)
    other = list(range(50, 58))
    cache.store(TOKENS, 1, scores_of(TOKENS))  # three blocks
    cache.lookup(TOKENS, 1, 4)  # the first block used again: the second is now the oldest
    cache.store(other, 1, scores_of(other))  # two more: the second and third of TOKENS go
    assert len(cache) == 3
    assert cache.lookup(TOKENS, 1, len(TOKENS)) == scores_of(TOKENS)[:3]
    assert cache.lookup(other, 1, len(other)) == scores_of(other)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="block size and capacity"):
        PromptScoreCache(0, b"", 4)
