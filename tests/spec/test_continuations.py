"""The local tier of the continuation cache: longest match, most frequent run, incremental learning, bounds."""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import tracemalloc

import pytest

from tandem.spec.continuations import (
    MAX_ENTRY_BYTES,
    MAX_TOKEN_ID,
    TYPICAL_ENTRY_BYTES,
    CacheHit,
    LocalContinuations,
    best_continuation,
    pack_tokens,
    unpack_tokens,
)


def cache(**kwargs) -> LocalContinuations:
    return LocalContinuations("fingerprint-a", **kwargs)


def test_pack_round_trip_and_range():
    for ids in ([], [0], [5, MAX_TOKEN_ID, 70000], list(range(1000, 1200))):  # both packing paths
        assert unpack_tokens(pack_tokens(ids)) == ids
    assert pack_tokens(list(range(200))) == b"".join(pack_tokens([t]) for t in range(200))
    for bad in ([MAX_TOKEN_ID + 1], [-1], [1] * 100 + [-1], [1] * 100 + [MAX_TOKEN_ID + 1]):
        with pytest.raises(ValueError):
            pack_tokens(bad)


def test_longest_matching_context_wins_over_a_more_frequent_shorter_one():
    c = cache(max_continuation=4)
    for _ in range(5):  # "2 3" is followed by 7 7 7 7 five times...
        c.learn([9, 2, 3, 7, 7, 7, 7], final=True)
    c.learn([1, 2, 3, 40, 41, 42, 43], final=True)  # ...but "1 2 3" once by 40 41 42 43
    assert c.lookup([5, 1, 2, 3], 3) == CacheHit([40, 41, 42], 3, 1, "local")
    assert c.lookup([5, 8, 2, 3], 3) == CacheHit([7, 7, 7], 2, 5, "local")


def test_most_frequent_continuation_of_the_same_context_wins():
    c = cache(max_continuation=3)
    c.learn([1, 2, 10, 11, 12], final=True)
    for _ in range(3):
        c.learn([1, 2, 20, 21, 22], final=True)
    c.learn([1, 2, 30, 31, 32], final=True)
    assert c.lookup([1, 2], 3) == CacheHit([20, 21, 22], 2, 3, "local")


def test_runs_sharing_a_prefix_add_up_token_by_token():
    # 20 21 is what followed "1 2" twice (with different tails); 30 31 32 once, but as one whole run
    c = cache(max_continuation=3)
    c.learn([1, 2, 30, 31, 32], final=True)
    c.learn([1, 2, 20, 21, 22], final=True)
    c.learn([1, 2, 20, 21, 23], final=True)
    hit = c.lookup([1, 2], 3)
    assert hit is not None and hit.tokens[:2] == [20, 21] and hit.count == 1
    assert c.lookup([1, 2], 2) == CacheHit([20, 21], 2, 2, "local")  # both runs contain all of it


def test_a_hit_carries_every_run_of_its_context_most_frequent_first_cut_to_k():
    c = cache(max_continuation=4)
    c.learn([1, 2, 10, 11, 12, 13], final=True)
    for _ in range(2):
        c.learn([1, 2, 20, 21, 22, 23], final=True)
    c.learn([9, 2, 30, 31, 32, 33], final=True)  # another context ("9 2", and "2" alone is below min_n)
    hit = c.lookup([1, 2], 3)
    assert hit.tokens == [20, 21, 22]
    assert hit.runs == ((20, 21, 22), (10, 11, 12))  # the tree's branches: both runs after "1 2"
    assert c.lookup([1, 2], 8).runs == ((20, 21, 22, 23), (10, 11, 12, 13))


def test_best_continuation_of_raw_runs():
    runs = [(pack_tokens([5, 6, 7]), 4), (pack_tokens([8, 9]), 3), (pack_tokens([8, 1]), 3)]
    assert best_continuation(runs, 5) == (pack_tokens([8, 9]), 3)  # 8 leads 6 to 4; then 9 and 1 tie: first
    assert best_continuation(runs, 1) == (pack_tokens([8]), 6)
    assert best_continuation([], 3) == (b"", 0)


def test_lookup_respects_k_and_short_or_unknown_contexts():
    c = cache(max_continuation=8)
    c.learn(list(range(100, 130)), final=True)
    assert c.lookup([100, 101], 4).tokens == [102, 103, 104, 105]
    assert c.lookup([100, 101], 100).tokens == list(range(102, 110))  # at most one run
    assert c.lookup([100, 101], 0) is None
    assert c.lookup([101], 4) is None  # shorter than min_n
    assert c.lookup([7, 8, 9], 4) is None
    hit = c.lookup([128], 4)
    assert hit is None
    assert c.lookup([127, 128], 4) == CacheHit([129], 2, 1, "local")  # the last position, learned by final


def test_contexts_longer_than_max_n_use_their_last_max_n_tokens():
    c = cache(max_n=4, max_continuation=2)
    c.learn([1, 2, 3, 4, 5, 6], final=True)
    assert c.lookup([99, 98, 97, 1, 2, 3, 4], 2) == CacheHit([5, 6], 4, 1, "local")


def test_incremental_learning_equals_learning_once():
    rng = random.Random(3)
    seq = [rng.randrange(50) for _ in range(300)]
    once, growing = cache(max_continuation=5), cache(max_continuation=5)
    once.learn(seq, final=True)
    cuts = [0, 1, 7, 8, 30, 31, 32, 100, 250, 296, 300]
    for prev, cut in zip(cuts, cuts[1:]):
        growing.learn(seq[:cut], start=prev, final=cut == len(seq))
    assert growing._entries == once._entries
    assert growing.stats.learned == once.stats.learned


def test_without_final_the_last_positions_wait_for_their_runs():
    c = cache(max_continuation=4)
    c.learn([1, 2, 3, 4, 5, 6])  # only the run after "1 2" has its 4 tokens yet
    assert c.lookup([1, 2], 4) == CacheHit([3, 4, 5, 6], 2, 1, "local")
    assert c.lookup([3, 4], 4) is None  # 5 6 may still grow: not recorded yet
    c.learn([1, 2, 3, 4, 5, 6, 7, 8], start=6, final=True)
    assert c.lookup([3, 4], 4) == CacheHit([5, 6, 7, 8], 2, 1, "local")
    assert c.lookup([1, 2], 4).count == 1  # nothing counted twice


def test_a_context_keeps_at_most_max_runs_runs():
    c = cache(max_continuation=2, max_runs=3)
    for _ in range(2):
        c.learn([1, 2, 50, 51], final=True)
    for t in range(10):
        c.learn([1, 2, 60 + t, 0], final=True)
    entry = c._entries[pack_tokens([1, 2])]
    assert len(entry) == 2 * 3
    assert entry[:2] == [pack_tokens([50, 51]), 2]  # the frequent run survives the churn
    assert c.lookup([1, 2], 2) == CacheHit([50, 51], 2, 2, "local")


def test_namespaces_are_separate_instances_and_must_be_named():
    a, b = LocalContinuations("tokenizer-a"), LocalContinuations("tokenizer-b")
    a.learn([1, 2, 3, 4], final=True)
    assert a.lookup([1, 2], 2) is not None and b.lookup([1, 2], 2) is None
    with pytest.raises(ValueError):
        LocalContinuations("")
    with pytest.raises(ValueError):
        LocalContinuations("x", min_n=5, max_n=4)


def test_entry_bound_holds_under_many_inserts_and_evicts_least_recent():
    rng = random.Random(0)
    c = cache(max_entries=5_000)
    c.learn([7, 7, 1000, 1001, 1002], final=True)
    for _ in range(100):
        c.learn([rng.randrange(5000) for _ in range(200)], final=True)
        assert c.size <= 5_000
        # a context asked for more often than the table turns over stays (LRU counts lookups)
        assert c.lookup([7, 7], 3) == CacheHit([1000, 1001, 1002], 2, 1, "local")
    assert c.stats.evictions > 100_000
    assert c.lookup([7, 7], 3) is not None
    assert c.approx_bytes <= c.max_bytes == 5_000 * MAX_ENTRY_BYTES


def _traced_bytes_per_entry(fill) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        c = fill()
        gc.collect()
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return used / c.size


def test_memory_per_entry_stays_within_the_stated_bounds():
    rng = random.Random(1)

    def typical() -> LocalContinuations:  # text-like: a skewed distribution of ids
        c = cache(max_entries=20_000)
        while c.size < 20_000:
            c.learn([int(rng.paretovariate(1.0) * 10) % 50_000 + 300 for _ in range(1000)], final=True)
        return c

    def worst() -> LocalContinuations:  # every context holds max_runs distinct full runs, big counts
        c = cache(max_entries=5_000)
        for _ in range(5_000):
            context = os.urandom(24)
            for _ in range(c.max_runs):
                c._add(context, os.urandom(48))
            entry = c._entries[context]
            for i in range(1, len(entry), 2):
                entry[i] = 1000 + rng.randrange(10**6)
        return c

    assert _traced_bytes_per_entry(typical) <= TYPICAL_ENTRY_BYTES * 1.15
    assert _traced_bytes_per_entry(worst) <= MAX_ENTRY_BYTES


def test_importing_the_cache_loads_no_torch():
    code = ("import sys; import tandem.spec.continuations, tandem.spec.shared_cache; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.strip() == "[]"
