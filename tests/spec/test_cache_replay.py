"""benchmarks/cache_replay.py: walking proposals along recorded samples, and what sharing a cache changes."""

from __future__ import annotations

import random

from benchmarks.cache_replay import FIXED, PER_MATCH, Policy, accepted_along, relative_cost, replay
from tandem.spec.tree import TokenTree


def test_a_tree_keeps_the_longest_path_the_sample_took():
    tree = TokenTree()
    tree.add_path([1, 2, 3])
    tree.add_path([1, 5])
    assert accepted_along(tree, [1, 2, 3, 4]) == 3
    assert accepted_along(tree, [1, 5, 9]) == 2  # the branch, not the chain
    assert accepted_along(tree, [2, 2]) == 0
    assert accepted_along(TokenTree(), [1]) == 0


def repeated_samples(prompts: int = 2, samples: int = 4, length: int = 64, vocab: int = 28000) -> list[dict]:
    """Each prompt's samples are one random sequence: whatever one sample generated, the next repeats."""
    rng = random.Random(0)
    rows = []
    for p in range(prompts):
        prompt = [rng.randrange(1000, 2000) for _ in range(20)]
        text = [rng.randrange(2000, 2000 + vocab) for _ in range(length)]
        rows += [{"prompt_id": f"p{p}", "sample": i, "prompt_ids": prompt, "token_ids": text} for i in range(samples)]
    return rows


def test_samples_reuse_what_earlier_samples_generated_only_where_the_cache_reaches():
    rows = repeated_samples()
    policy = Policy("fixed", k_rule=FIXED)
    price = relative_cost(None)  # every round one step: speed is tokens per round
    alone, local, shared = (replay(rows, policy, sharing, price) for sharing in ("none", "local", "shared"))
    assert alone["cache"] == 0 and alone["tokens_per_round"] < 1.2  # random text: its own text rarely repeats
    # local: sample i sees sample i - 2 (same coordinator); shared: sample i - 1 as well, so sample 1 gains too
    assert shared["tokens_per_round"] > local["tokens_per_round"] > alone["tokens_per_round"]
    assert local["speed_vs_target_only"] == local["tokens_per_round"]
    assert shared["oracle_speed"] >= shared["speed_vs_target_only"]


def test_dear_rows_make_the_per_kind_rule_verify_fewer_nodes_than_fixed_k():
    rows = repeated_samples(samples=1, length=300, vocab=12)  # short matches of its own text, mostly wrong
    dear = relative_cost({"rows": [1, 2, 9], "seconds": [1.0, 1.5, 5.0]})
    fixed = replay(rows, Policy("fixed", k_rule=FIXED), "none", dear)
    per_kind = replay(rows, Policy("per kind", k_rule=PER_MATCH), "none", dear)
    assert per_kind["nodes_per_round"] < fixed["nodes_per_round"]
    assert per_kind["speed_vs_target_only"] > fixed["speed_vs_target_only"]
