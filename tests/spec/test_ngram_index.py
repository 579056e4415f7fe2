"""NgramIndex proposes exactly what the full scan of the history proposes, round after round.

Two references: a slow pure-Python scan written from the rule (the latest earlier
occurrence of the longest suffix; an occurrence is earlier when a token follows it), and
``tandem.spec.ngram``'s vectorised scans, which the loop used before the index. Greedy
outputs and the committed replays depend on the proposals being the same, tie-breaking
included, so the comparison is exact, on random histories with many repeats (small
vocabularies), grown in random steps as a request's history grows.
"""

from __future__ import annotations

import random

import pytest

from tandem.spec.continuations import LocalContinuations, continuation_items, pack_tokens
from tandem.spec.ngram import NgramIndex, lookup_continuations, lookup_match
from tandem.spec.proposers import ngram_proposal


def scan_match(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """The rule, slowly: for n from max_n down, the latest i < len - n with tokens[i:i+n] == the suffix."""
    if k <= 0:
        return [], 0
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for i in range(length - 1 - n, -1, -1):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k], n
    return [], 0


def scan_continuations(tokens: list[int], k: int, min_n: int, max_n: int, limit: int) -> list[tuple[list[int], int]]:
    """Every earlier occurrence, longest suffix first, most recent first; one per first token, at most ``limit``."""
    if k <= 0 or limit <= 0:
        return []
    length, found, firsts = len(tokens), [], set()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for i in range(length - 1 - n, -1, -1):
            if tokens[i : i + n] == suffix and tokens[i + n] not in firsts:
                firsts.add(tokens[i + n])
                found.append((tokens[i + n : i + n + k], n))
                if len(found) == limit:
                    return found
    return found


@pytest.mark.parametrize("seed", range(6))
def test_the_index_answers_as_the_full_scan_on_random_growing_histories(seed):
    rng = random.Random(seed)
    checked = 0
    for _ in range(25):
        vocab = rng.randint(2, 7)  # few symbols: long repeats, many ties between occurrences
        history: list[int] = [rng.randrange(vocab)]
        index = NgramIndex()
        while len(history) < rng.randint(20, 160):
            history += [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]  # a round's commits
            k, min_n = rng.randint(1, 6), rng.randint(1, 4)
            max_n, limit = min_n + rng.randint(0, 3), rng.randint(1, 4)
            expected = scan_match(history, k, min_n, max_n)
            assert lookup_match(history, k, min_n, max_n) == expected  # the references agree
            assert index.lookup_match(history, k, min_n, max_n) == expected, (history, k, min_n, max_n)
            branches = scan_continuations(history, k, min_n, max_n, limit)
            assert lookup_continuations(history, k, min_n, max_n, limit) == branches
            assert index.lookup_continuations(history, k, min_n, max_n, limit) == branches, (history, k, limit)
            checked += 1
    assert checked > 100


def test_long_repeats_and_ties_take_the_latest_occurrence():
    index = NgramIndex()
    history = [7] * 30  # every occurrence overlaps the suffix: the latest is one position back
    assert index.lookup_match(history, 4, 1, 4) == scan_match(history, 4, 1, 4) == ([7], 4)
    history += [1, 7, 7, 2, 7, 7, 7, 7]  # "7 7 7 7" was last followed by 1, "2 7 7 7" never
    assert index.lookup_match(history, 3, 1, 4) == scan_match(history, 3, 1, 4)
    assert index.lookup_continuations(history, 3, 1, 4, 4) == scan_continuations(history, 3, 1, 4, 4)


def test_k_or_limit_zero_and_histories_too_short_propose_nothing():
    index = NgramIndex()
    assert index.lookup_match([5], 3, 1, 3) == ([], 0)
    assert index.lookup_match([5, 5], 0, 1, 3) == ([], 0)
    assert index.lookup_continuations([5, 5, 5], 2, 1, 3, 0) == []
    assert index.lookup_match([5, 5], 3, 1, 3) == ([5], 1)
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        index.lookup_match([5, 5], 3, 0, 3)


def test_sizes_asked_for_later_are_indexed_back_to_the_start():
    rng = random.Random(11)
    history = [rng.randrange(3) for _ in range(80)]
    index = NgramIndex()
    assert index.lookup_match(history, 3, 1, 1) == scan_match(history, 3, 1, 1)
    history += [rng.randrange(3) for _ in range(5)]
    for min_n, max_n in ((3, 5), (1, 6), (2, 2)):  # sizes 2..6 are new after 80 tokens
        assert index.lookup_match(history, 3, min_n, max_n) == scan_match(history, 3, min_n, max_n)
        assert index.lookup_continuations(history, 3, min_n, max_n, 3) == scan_continuations(history, 3, min_n,
                                                                                            max_n, 3)


def test_a_history_other_than_the_one_indexed_is_indexed_afresh():
    index = NgramIndex()
    first = [1, 2, 3, 1, 2, 3, 1, 2]
    assert index.lookup_match(first, 2, 1, 3) == ([3, 1], 3)
    for other in ([1, 2, 3, 1], [4, 5, 6, 4, 5, 6, 4, 9, 4, 5]):  # shorter; same length class, other last token
        assert index.lookup_match(other, 2, 1, 3) == scan_match(other, 2, 1, 3)
        assert index.indexed == len(other)


def test_ngram_proposal_with_an_index_equals_the_scan():
    history = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 1, 4, 1]
    index = NgramIndex()
    with_index, matched = ngram_proposal(history, 3, 1, 4, index)
    scanned, scanned_matched = ngram_proposal(history, 3, 1, 4)
    # "3 1 4 1" occurred before, followed by 5 9 2
    assert (with_index.tokens, matched) == (scanned.tokens, scanned_matched) == ([5, 9, 2], 4)


@pytest.mark.parametrize("seed", range(3))
def test_learning_a_growing_sequence_round_by_round_teaches_what_packing_it_whole_did(seed):
    """``learn`` now reads only the tail the new observations need; the table it builds is the same."""
    rng = random.Random(seed)
    tokens = [rng.randrange(5) for _ in range(300)]
    cache = LocalContinuations("ns", min_n=2, max_n=6, max_continuation=8)
    reference = LocalContinuations("ns", min_n=2, max_n=6, max_continuation=8)
    learned = 0
    for end in [*sorted(rng.sample(range(1, 300), 40)), 300]:
        final = end == 300
        whole = continuation_items(pack_tokens(tokens[:end]), learned, final, reference.orders, 8)  # main's learn
        assert cache.learn(tokens[:end], learned, final=final) == reference.add_items(whole)
        assert list(cache._entries.items()) == list(reference._entries.items())  # same runs, counts, LRU order
        learned = end
