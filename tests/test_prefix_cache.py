"""The prefix cache inside the paged KV pool: hash chains, reference counts, LRU eviction, copy on write."""

from __future__ import annotations

import pytest
import torch

from tandem.block_pool import block_hash
from tandem.errors import KVCacheExhaustedError
from tandem.kv_cache import PagedKVCache

BS = 4


def make_cache(num_blocks: int = 8, prefix_caching: bool = True) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_blocks=num_blocks, block_size=BS, num_kv_heads=1, head_dim=2,
                        dtype=torch.float32, prefix_caching=prefix_caching, salt=b"model|fp32")


def fill(cache: PagedKVCache, seq: str, tokens: list[int]) -> None:
    """Append ``tokens`` to ``seq`` and write a KV that is a function of (position, token), as a model's is."""
    start = cache.length(seq) if cache.has_sequence(seq) else 0
    slots = cache.append_slots({seq: len(tokens) - start})[seq]
    for layer in range(2):
        values = torch.tensor([[p * 1000.0 + t + layer] for p, t in enumerate(tokens[start:], start)])
        kv = values.repeat(1, 2)[:, None, :]  # [n, Hkv=1, D=2]
        cache.write(layer, slots, kv, -kv)


def kv_of(cache: PagedKVCache, seq: str) -> torch.Tensor:
    slots = cache.slots(seq, list(range(cache.length(seq))))
    return cache.key.view(2, -1, 1, 2)[:, slots].clone()


def block_contents(cache: PagedKVCache) -> dict[bytes, torch.Tensor]:
    """Every registered block's K and V, by content hash."""
    pool = cache.pool
    return {content: torch.stack([cache.key[:, block], cache.value[:, block]]).clone()
            for block, content in pool._hash_of.items()}


PROMPT = list(range(10, 20))  # 10 tokens: 2 full blocks and a partial one


def test_committed_full_blocks_are_reused_by_a_prompt_that_starts_the_same_way():
    cache = make_cache()
    fill(cache, "a", PROMPT)
    cache.commit("a", PROMPT, upto=len(PROMPT))
    assert cache.prefix_stats().cached_blocks == 2  # the partial third block is not cached
    reused = cache.reuse_prefix("b", [*PROMPT[:9], 99, 98], limit=10)
    assert reused == 8
    assert cache.sequence("b").block_ids == cache.sequence("a").block_ids[:2]
    assert [cache.pool.refcount(b) for b in cache.sequence("a").block_ids[:2]] == [2, 2]
    stats = cache.prefix_stats()
    assert (stats.prompt_tokens, stats.reused_tokens) == (11, 8)


def test_the_chain_names_the_whole_prefix_not_just_the_block():
    cache = make_cache()
    fill(cache, "a", PROMPT)
    cache.commit("a", PROMPT, upto=len(PROMPT))
    # Same second block, different first block: nothing may be reused, not even the second.
    assert cache.reuse_prefix("b", [0, 1, 2, 3, *PROMPT[4:]], limit=9) == 0
    # And a different salt (another model or dtype) never matches.
    assert block_hash(b"model|fp32", PROMPT[:4]) != block_hash(b"model|bf16", PROMPT[:4])


def test_reuse_is_bounded_by_the_limit_and_off_when_disabled():
    cache = make_cache()
    fill(cache, "a", PROMPT[:8])
    cache.commit("a", PROMPT[:8], upto=8)
    assert cache.reuse_prefix("b", PROMPT[:8], limit=7) == 4  # the last token must be computed
    off = make_cache(prefix_caching=False)
    fill(off, "a", PROMPT)
    off.commit("a", PROMPT, upto=10)
    assert off.reuse_prefix("b", PROMPT, limit=9) == 0 and off.prefix_stats().cached_blocks == 0


def test_a_peek_at_the_cached_prefix_counts_what_reuse_would_take_and_changes_nothing():
    """``cached_prefix_len`` prices a draft's read before it is made: it must see what ``reuse_prefix`` takes,
    yet hold no block and count no lookup (a request that never reads must leave the pool as it was)."""
    cache = make_cache()
    fill(cache, "a", PROMPT)
    cache.commit("a", PROMPT, upto=len(PROMPT))
    cache.release("a")
    before = (cache.num_free_blocks, cache.prefix_stats())
    assert cache.cached_prefix_len(PROMPT) == 8
    assert cache.cached_prefix_len([*PROMPT[:5], 0, *PROMPT[6:]]) == 4  # the second block differs
    assert cache.cached_prefix_len(PROMPT[:7]) == 4  # whole blocks only
    assert cache.cached_prefix_len([0, *PROMPT[1:]]) == 0  # a chain: nothing after a miss
    assert (cache.num_free_blocks, cache.prefix_stats()) == before
    assert cache.reuse_prefix("b", PROMPT, limit=len(PROMPT)) == 8
    assert make_cache(prefix_caching=False).cached_prefix_len(PROMPT) == 0


def test_only_committed_tokens_are_registered():
    cache = make_cache()
    fill(cache, "a", PROMPT)
    cache.commit("a", PROMPT, upto=6)  # tokens 6.. are drafts: only block 0 is wholly committed
    assert cache.prefix_stats().cached_blocks == 1
    assert cache.reuse_prefix("b", PROMPT, limit=9) == 4


def test_released_blocks_stay_cached_and_evict_least_recently_used_first():
    cache = make_cache(num_blocks=4)
    fill(cache, "old", [1, 2, 3, 4])
    cache.commit("old", [1, 2, 3, 4], upto=4)
    fill(cache, "new", [5, 6, 7, 8])
    cache.commit("new", [5, 6, 7, 8], upto=4)
    cache.release("old")
    cache.release("new")
    stats = cache.prefix_stats()
    assert (stats.cached_blocks, stats.evictable_blocks, cache.num_free_blocks) == (2, 2, 4)
    fill(cache, "c", list(range(100, 112)))  # 3 blocks: 2 free ones, then the least recently released
    assert cache.prefix_stats().evictions == 1
    assert cache.reuse_prefix("x", [1, 2, 3, 4, 0], limit=4) == 0  # "old" went first
    assert cache.reuse_prefix("y", [5, 6, 7, 8, 0], limit=4) == 4  # "new" is still there


def test_a_held_cached_block_is_never_evicted():
    cache = make_cache(num_blocks=2)
    fill(cache, "a", [1, 2, 3, 4])
    cache.commit("a", [1, 2, 3, 4], upto=4)
    cache.release("a")
    assert cache.reuse_prefix("b", [1, 2, 3, 4, 5], limit=4) == 4  # held again by b
    fill(cache, "c", [7, 7, 7, 7])  # takes the one free block
    with pytest.raises(KVCacheExhaustedError):
        fill(cache, "d", [8])  # b's cached block is held: nothing to evict
    assert cache.length("b") == 4


def test_rollback_into_a_shared_block_copies_it_and_leaves_the_cached_content_unchanged():
    cache = make_cache()
    fill(cache, "a", PROMPT)
    cache.commit("a", PROMPT, upto=10)
    cached = block_contents(cache)
    assert cache.reuse_prefix("b", PROMPT, limit=9) == 8
    shared = cache.sequence("b").block_ids[1]
    cache.rollback("b", 6)  # b will write positions 6.. inside the shared second block
    assert cache.sequence("b").block_ids[1] != shared  # a private copy
    assert cache.pool.refcount(shared) == 1  # a alone holds the cached one
    fill(cache, "b", [*PROMPT[:6], 77, 78, 79])  # b's own continuation
    assert all(torch.equal(cached[h], now) for h, now in block_contents(cache).items())
    assert torch.equal(kv_of(cache, "b")[:, :6], kv_of(cache, "a")[:, :6])  # the copy kept what b had


def test_rollback_into_a_block_held_alone_takes_it_out_of_the_index():
    cache = make_cache()
    fill(cache, "a", PROMPT[:8])
    cache.commit("a", PROMPT[:8], upto=8)
    cache.rollback("a", 6)  # a rewrites positions 6.. (a start-over, say)
    fill(cache, "a", [*PROMPT[:6], 55, 56])
    assert cache.reuse_prefix("b", PROMPT[:8] + [0], limit=8) == 4  # only the intact first block is found
    assert cache.prefix_stats().cached_blocks == 1


def test_reference_counts_and_free_blocks_return_to_baseline():
    cache = make_cache(num_blocks=8)
    for seq in ("a", "b", "c"):
        cache.reuse_prefix(seq, PROMPT, limit=9)  # b and c share a's first two blocks
        fill(cache, seq, [*PROMPT, 1, 2, 3])
        cache.commit(seq, [*PROMPT, 1, 2, 3], upto=12)
    cache.rollback("b", 5)
    for seq in ("a", "b", "c"):
        cache.release(seq)
    pool = cache.pool
    assert all(pool.refcount(b) == 0 for b in range(8))
    assert cache.num_free_blocks == 8 and not cache.sequences()
    assert pool.available == pool.num_free + cache.prefix_stats().evictable_blocks


def test_a_duplicate_block_computed_twice_stays_private():
    cache = make_cache()
    for seq in ("a", "b"):  # two prompts computed at the same time, before either was registered
        fill(cache, seq, PROMPT[:4])
    cache.commit("a", PROMPT[:4], upto=4)
    cache.commit("b", PROMPT[:4], upto=4)
    assert cache.prefix_stats().cached_blocks == 1
    cache.release("b")  # its block is not in the index: free at once
    assert cache.pool.num_free == 7
