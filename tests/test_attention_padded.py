"""Padded attention (the backend a captured CUDA graph replays) against the slow reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.attention.padded import PaddedPagedAttention
from tandem.attention.reference import ReferenceAttention
from tests.test_attention_backends import TREE, D, random_batch, run


@pytest.mark.parametrize("context_lens,query_len", [([9], 1), ([0, 17, 40], 1), ([12, 3, 20, 0], 5), ([63], 3)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_padded_attention_matches_reference_for_batches_of_one_query_length(context_lens, query_len, block_size):
    cache, meta, query = random_batch(context_lens, [query_len] * len(context_lens), block_size)
    got = run(PaddedPagedAttention(), cache, meta, query)
    want = run(ReferenceAttention(), cache, meta, query)
    assert (got - want).abs().max().item() < 1e-5


def test_a_wider_window_than_any_sequence_needs_changes_nothing_but_the_work():
    """A graph's block tables span its context bucket: the blocks past a sequence's length (other sequences',
    or block 0) are masked, whatever they hold."""
    cache, meta, query = random_batch([5, 30], [2, 2], 4)
    want = run(PaddedPagedAttention(), cache, meta, query)
    wide = torch.zeros(2, meta.block_tables.shape[1] + 6, dtype=meta.block_tables.dtype)
    wide[:, : meta.block_tables.shape[1]] = meta.block_tables
    wide[0, meta.block_tables.shape[1]:] = 7  # another sequence's block: masked by length
    meta.block_tables = wide
    got = run(PaddedPagedAttention(), cache, meta, query)
    assert (got - want).abs().max().item() < 1e-6


def test_each_query_head_reads_its_own_kv_head():
    """Grouped-query attention: head h reads KV head h // (H / Hkv), as transformers' repeat_kv lays them out."""
    cache, meta, query = random_batch([6], [1], 4)
    got = run(PaddedPagedAttention(), cache, meta, query)  # [1, H, D]
    keys = cache.key[0].view(-1, *cache.key.shape[-2:])[cache.block_table([0])[0].repeat_interleave(4) * 4
                                                         + torch.arange(4).repeat(2)][:7]  # [7, Hkv, D]
    values = cache.value[0].view(-1, *cache.value.shape[-2:])[cache.block_table([0])[0].repeat_interleave(4) * 4
                                                              + torch.arange(4).repeat(2)][:7]
    heads, kv_heads = query.shape[1], keys.shape[1]
    for head in range(heads):
        kv = head // (heads // kv_heads)
        weights = F.softmax(query[0, head] @ keys[:, kv].T * D**-0.5, dim=-1)  # [7]
        assert torch.allclose(got[0, head], weights @ values[:, kv], atol=1e-5)


def test_padded_attention_refuses_a_tree():
    cache, meta, query = random_batch([10], [len(TREE)], 4, tree_parents=[TREE])
    with pytest.raises(ValueError, match="chains only"):
        PaddedPagedAttention().prepare(meta)
