"""Seeded sampled output with speculation is plain seeded output, token for token, for every proposer.

A seeded request's token at each position is the target's own seeded draw there
(``tandem.spec.rejection``, "Seeded sampling"), so whatever the drafts, k, trees or
caches, its output repeats exactly and equals what plain decoding samples. Real tiny
engines through the in-process generator (the one loop).
"""

from __future__ import annotations

import pytest

from draft_worker.engine import early_exit_engine
from tandem.sampling import SamplingParams
from tests.spec.test_greedy_equivalence import load, run

SAMPLING = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234)


@pytest.fixture(scope="module")
def target(tiny_qwen2_dir):
    return load(tiny_qwen2_dir)


@pytest.fixture(scope="module")
def plain(target):
    return [r.token_ids for r in run(target, None, sampling=SAMPLING)]


def test_a_draft_of_the_targets_own_model_is_kept_and_changes_nothing(target, plain, tiny_qwen2_dir):
    """The draft draws from the target's noise at each position: with q = p its tokens are the target's."""
    results = run(target, load(tiny_qwen2_dir), "draft", sampling=SAMPLING, k_max=4)
    assert [r.token_ids for r in results] == plain
    drafted, accepted = sum(r.stats.drafted for r in results), sum(r.stats.accepted for r in results)
    assert drafted > 0 and accepted >= 0.9 * drafted, (accepted, drafted)  # float16 on the wire: rare near-ties
    assert target.kv_cache.num_free_blocks == target.kv_cache.num_blocks


@pytest.mark.parametrize("method,tree", [("draft", "off"), ("hybrid", "off"), ("ngram", "off"), ("draft", "on"),
                                         ("hybrid", "on"), ("ngram", "on")])
def test_every_proposer_gives_the_plain_seeded_output(target, plain, tiny_qwen2_other_dir, method, tree):
    draft = None if method == "ngram" else load(tiny_qwen2_other_dir)
    results = run(target, draft, method, sampling=SAMPLING, k_max=3, ngram_max=3, hybrid_min_match=2, tree=tree,
                  tree_width=2)
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.drafted for r in results) > 0


def test_lean_adaptive_and_early_exit_drafts_give_the_plain_seeded_output(target, plain, tiny_qwen2_dir):
    lean = load(tiny_qwen2_dir, quantization="int8", vocab_limit=32)
    for draft, method, adaptive in [(lean, "draft", True), (early_exit_engine(target, 1), "early-exit", False)]:
        results = run(target, draft, method, sampling=SAMPLING, k_max=4, adaptive_k=adaptive)
        assert [r.token_ids for r in results] == plain, method


def test_another_seed_samples_otherwise(target, plain):
    other = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1235)
    assert [r.token_ids for r in run(target, None, sampling=other)] != plain
