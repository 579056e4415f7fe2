"""The paged KV pool: allocation, rollback, release, exhaustion."""

from __future__ import annotations

import pytest
import torch

from tandem.errors import KVCacheExhaustedError, UnknownSequenceError
from tandem.kv_cache import PagedKVCache


def make_cache(num_blocks: int = 4, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_blocks=num_blocks, block_size=block_size, num_kv_heads=1,
                        head_dim=2, dtype=torch.float32)


def test_append_allocates_whole_blocks_and_maps_slots():
    cache = make_cache()
    slots = cache.append_slots({"a": 6})["a"]
    assert cache.length("a") == 6
    assert len(cache.sequence("a").block_ids) == 2
    blocks = cache.sequence("a").block_ids
    assert slots.tolist() == [blocks[0] * 4 + i for i in range(4)] + [blocks[1] * 4 + i for i in range(2)]
    assert cache.num_free_blocks == 2


def test_rollback_frees_blocks_past_the_new_end():
    cache = make_cache()
    cache.append_slots({"a": 10})  # 3 blocks
    cache.rollback("a", 4)
    assert cache.length("a") == 4 and len(cache.sequence("a").block_ids) == 1
    assert cache.num_free_blocks == 3
    cache.rollback("a", 0)
    assert cache.num_free_blocks == 4


def test_rollback_beyond_length_is_refused():
    cache = make_cache()
    cache.append_slots({"a": 3})
    with pytest.raises(ValueError, match="holds 3 tokens"):
        cache.rollback("a", 5)


def test_exhaustion_raises_specific_error_and_changes_nothing():
    cache = make_cache(num_blocks=2)
    cache.append_slots({"a": 5})
    with pytest.raises(KVCacheExhaustedError, match="needs 1 more blocks of 4 tokens, 0 of 2 are free"):
        cache.append_slots({"a": 3, "b": 4})  # a still fits its 2 blocks; b needs a third
    assert cache.length("a") == 5 and not cache.has_sequence("b")
    assert cache.num_free_blocks == 0


def test_release_returns_everything_and_unknown_ids_are_named():
    cache = make_cache()
    cache.append_slots({"a": 7, "b": 1})
    cache.release("a")
    cache.release("b")
    assert cache.num_free_blocks == 4
    with pytest.raises(UnknownSequenceError, match="unknown sequence 'a'"):
        cache.release("a")


def test_write_stores_at_the_mapped_slots():
    cache = make_cache()
    slots = cache.append_slots({"a": 5})["a"]
    key = torch.arange(10, dtype=torch.float32).view(5, 1, 2)
    cache.write(1, slots, key, -key)
    flat = cache.key[1].view(-1, 1, 2)
    assert torch.equal(flat[slots], key)
    assert torch.equal(cache.value[1].view(-1, 1, 2)[slots], -key)


def test_admission_counts_blocks_given_back_first_and_changes_nothing():
    cache = PagedKVCache(num_layers=1, num_blocks=6, block_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    cache.append_slots({"a": 16})  # 4 blocks held, 2 free
    free_before = cache.num_free_blocks
    # b wants 3 blocks (only 2 free) but a rolls back to 4 tokens first, giving 3 back
    assert cache.admit([("b", 12), ("a", 4)]) == [None, None]
    assert cache.admit([("b", 8), ("c", 4)]) == [None, 1]  # b takes both free blocks: c is 1 short
    assert cache.admit([("b", 40)]) == [8]
    assert cache.num_free_blocks == free_before and cache.length("a") == 16


def test_when_the_pool_runs_short_the_oldest_sequences_grow_and_the_youngest_are_refused():
    """Whatever order the calls came in: the oldest go on and finish, the youngest wait (preempted)."""
    cache = PagedKVCache(num_layers=1, num_blocks=6, block_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    cache.append_slots({"old": 8})  # 2 blocks
    cache.append_slots({"young": 8})  # 2 blocks: 2 left
    assert cache.admit([("young", 16), ("old", 16)]) == [2, None]  # old takes the 2 left; young is 2 short
    assert cache.admit([("new", 8), ("young", 12)]) == [1, None]  # a new sequence comes after every held one
    assert cache.admit([("new", 4), ("young", 12), ("old", 12)]) == [1, None, None]


def test_a_new_sequence_leaves_the_running_ones_room_to_grow():
    """With ``growth``, a prompt starts only while every held sequence (its own too) keeps free the blocks it will
    grow into: a burst of prompts no longer fills the room the running sequences need the rounds after."""
    cache = PagedKVCache(num_layers=1, num_blocks=10, block_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    cache.append_slots({"a": 8, "b": 6})  # 2 + 2 blocks held, 6 free; 8 more tokens take a 2 blocks, b 2
    by = lambda tokens: lambda seq_id, length: tokens  # noqa: E731 - every sequence grows this much
    assert cache.admit([("new", 4)]) == [None]  # without a reserve: 1 of the 6 free blocks
    assert cache.admit([("new", 4)], by(8)) == [1]  # 1 + 4 reserved for a and b + 2 of its own: 1 short
    assert cache.admit([("new", 4)], by(4)) == [None]  # 1 + 2 reserved + 1 of its own: fits
    # each one admitted adds its own room: the third finds 4 free and 4 + 1 of its own reserved
    assert cache.admit([("n1", 4), ("n2", 4), ("n3", 4)], by(4)) == [None, None, 2]
    assert cache.admit([("a", 16), ("b", 12)], by(8)) == [None, None]  # running ones may use the reserve
    # per sequence: a is about to end (no room kept), b grows 8: 1 + 2 + 2 of its own fits
    assert cache.admit([("new", 4)], lambda seq_id, length: 0 if seq_id == "a" else 8) == [None]
    assert cache.num_free_blocks == 6  # (nothing changed)


def test_a_higher_priority_goes_first_and_the_lowest_are_refused_when_the_pool_runs_short():
    """``rank`` (lower first): a new sequence goes before the growth of sequences ranked below it, and keeps free
    only the room of those ranked as high or higher; held sequences ranked below are the ones refused."""
    cache = PagedKVCache(num_layers=1, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    cache.append_slots({"low": 8})  # 2 blocks, the oldest
    cache.append_slots({"high": 8})  # 2 blocks: 4 left
    ranks = {"low": 1, "high": 0, "urgent": 0, "bulk": 1}
    rank = ranks.__getitem__
    # each wants 3 more blocks: by age alone low grows and high is 2 short; by rank high grows and low is refused
    assert cache.admit([("low", 20), ("high", 20)]) == [None, 2]
    assert cache.admit([("low", 20), ("high", 20)], rank=rank) == [2, None]
    # a new sequence of rank 0 goes before low's growth: urgent takes 3 of the 4 free blocks, low is 1 short
    assert cache.admit([("low", 16), ("urgent", 12)], rank=rank) == [1, None]
    # ...and a new one of rank 1 still comes after every held one, as before
    assert cache.admit([("low", 16), ("bulk", 12)], rank=rank) == [None, 1]
    # the room kept for growth: 8 tokens each, 2 blocks for low and 2 for high (and 2 of its own)
    by8 = lambda seq_id, length: 8  # noqa: E731
    assert cache.admit([("urgent", 4)], by8) == [3]  # 1 + 4 reserved + 2 of its own in 4 free
    assert cache.admit([("urgent", 4)], by8, rank) == [1]  # low's room is not kept from it: 1 + 2 + 2
    assert cache.admit([("bulk", 4)], by8, rank) == [3]  # a rank-1 prompt keeps both rooms free
    assert cache.num_free_blocks == 4  # (nothing changed)


def test_a_waiting_prompt_takes_what_is_free_before_the_calls_ranked_below_it():
    """``waiting``: (rank, arrival, blocks) of a refused prompt that keeps its place; without arrivals it comes after
    the calls of its own rank and before those ranked below, which are refused as they grow until it fits."""
    cache = PagedKVCache(num_layers=1, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    cache.append_slots({"low": 8, "high": 8})  # 4 left
    rank = {"low": 1, "high": 0, "new": 0, "bulk": 1}.__getitem__
    waiting = [(0, 0.0, 3)]  # a rank-0 prompt of 3 blocks waits
    assert cache.admit([("low", 12)], rank=rank, waiting=waiting) == [None]  # 1 free after the waiting 3
    assert cache.admit([("low", 16)], rank=rank, waiting=waiting) == [1]  # 2 more: refused
    assert cache.admit([("high", 16)], rank=rank, waiting=waiting) == [None]  # its own rank goes first
    assert cache.admit([("bulk", 4)], rank=rank, waiting=waiting) == [None]  # 1 block: the one left
    assert cache.admit([("bulk", 8)], rank=rank, waiting=waiting) == [1]
    assert cache.admit([("new", 8)], rank=rank, waiting=waiting) == [None]  # a new rank-0 one is not held back
    assert cache.admit([("low", 16)], rank=rank, waiting=[(1, 0.0, 3)]) == [None]  # a rank-1 wait: low is older
    assert cache.admit([("low", 16)], rank=rank, waiting=[(0, 0.0, 9)]) == [2]  # a wait bigger than what is free


def test_a_waiting_prompt_goes_before_the_new_prompts_of_its_rank_that_arrived_after_it():
    """With arrivals (several coordinators' requests, ``tandem.rpc.room_waits``), new prompts of one rank and the
    waiting ones take what is free in the order they arrived; held sequences of that rank still go first."""
    cache = PagedKVCache(num_layers=1, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    cache.append_slots({"old": 8})  # 6 free
    arrived = {"early": 10.0, "late": 30.0, "old": 0.0}.__getitem__
    waiting = [(0, 20.0, 4)]  # a prompt of 4 blocks that arrived at 20 waits
    assert cache.admit([("late", 12)], waiting=waiting, arrival=arrived) == [1]  # 3 blocks after its 4: refused
    assert cache.admit([("early", 12)], waiting=waiting, arrival=arrived) == [None]  # came first: goes first
    assert cache.admit([("late", 8)], waiting=waiting, arrival=arrived) == [None]  # 2 blocks: what it leaves
    assert cache.admit([("old", 24)], waiting=waiting, arrival=arrived) == [None]  # held: grows into all 6
    assert cache.admit([("early", 12), ("late", 8)], waiting=waiting, arrival=arrived) == [None, 2]  # none left
    assert cache.admit([("late", 12)], waiting=waiting) == [None]  # without arrivals the wait goes after new ones
    assert cache.num_free_blocks == 6  # (nothing changed)


def test_a_refused_new_prompt_that_keeps_its_place_sets_aside_what_is_free_against_the_calls_after_it():
    """``keeps_place``: a new prompt refused in this batch that keeps its place (a prompt held at the worker asks in
    every batch, so its place from an earlier refusal never applies) takes what is free, up to its blocks, before
    the calls after it: lower ranks' growth and the later prompts of its rank."""
    cache = PagedKVCache(num_layers=1, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    cache.append_slots({"low": 8})  # 6 free
    rank = {"low": 1, "urgent": 0, "late": 0}.__getitem__
    arrived = {"urgent": 10.0, "late": 20.0, "low": 0.0}.__getitem__
    calls = [("urgent", 28), ("low", 16), ("late", 4)]  # urgent needs 7 blocks: refused either way
    assert cache.admit(calls, rank=rank, arrival=arrived) == [1, None, None]  # the others took its room
    assert cache.admit(calls, rank=rank, arrival=arrived, keeps_place=lambda s: s == "urgent") == [1, 2, 1]
    assert cache.admit(calls, rank=rank, arrival=arrived, keeps_place=lambda s: False) == [1, None, None]


def test_slots_resolve_positions_through_the_block_table():
    cache = make_cache()
    cache.append_slots({"pad": 1})
    appended = cache.append_slots({"a": 7})["a"]
    assert cache.slots("a", [6, 0, 3, 4]).tolist() == appended[[6, 0, 3, 4]].tolist()
    with pytest.raises(ValueError, match="holds 7 tokens: no position 7"):
        cache.slots("a", [2, 7])
    with pytest.raises(UnknownSequenceError):
        cache.slots("b", [0])


def test_move_copies_every_layer_and_overlapping_moves_read_before_writing():
    cache = make_cache()
    slots = cache.append_slots({"a": 8})["a"]
    for layer in range(2):
        values = torch.arange(8, dtype=torch.float32)[:, None, None].expand(8, 1, 2) + 100 * layer  # [8, 1, 2]
        cache.write(layer, slots, values, -values)
    before_k, before_v = cache.key.clone(), cache.value.clone()
    # A path shifted down over its own rows: 5 -> 4 while 4 -> 3 (and 4's old value must be what lands in 3).
    src, dst = cache.slots("a", [4, 5, 7]), cache.slots("a", [3, 4, 5])
    cache.move(src, dst)
    flat_k = cache.key.view(2, -1, 1, 2)
    flat_v = cache.value.view(2, -1, 1, 2)
    old_k, old_v = before_k.view(2, -1, 1, 2), before_v.view(2, -1, 1, 2)
    assert torch.equal(flat_k[:, dst], old_k[:, src]) and torch.equal(flat_v[:, dst], old_v[:, src])
    untouched = [s for s in range(flat_k.shape[1]) if s not in dst.tolist()]
    assert torch.equal(flat_k[:, untouched], old_k[:, untouched])
    assert torch.equal(flat_v[:, untouched], old_v[:, untouched])
    assert flat_k[1, dst[0], 0, 0].item() == 104.0  # layer 1 moved too
    with pytest.raises(ValueError, match="two \\[n\\] slot lists"):
        cache.move(src, dst[:2])
