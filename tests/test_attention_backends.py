"""SDPA and flash-attn plumbing against the slow reference, on random paged ragged batches."""

from __future__ import annotations

import types

import pytest
import torch

from tandem.attention.base import AttentionMetadata
from tandem.attention.flash import FlashAttention
from tandem.attention.reference import ReferenceAttention
from tandem.attention.sdpa import SdpaAttention
from tandem.kv_cache import PagedKVCache

H, HKV, D = 4, 2, 16


def random_batch(context_lens, query_lens, block_size, dtype=torch.float32, seed=0):
    """A cache holding random K/V for each sequence's context + new tokens, its metadata and queries."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, 64, block_size, HKV, D, dtype)
    cache.append_slots({"pad": 3})  # so sequences do not start at block 0
    slot_rows = []
    for i, (c, q) in enumerate(zip(context_lens, query_lens)):
        slots = cache.append_slots({i: c + q})[i]
        keys = torch.randn(c + q, HKV, D, generator=g).to(dtype)
        values = torch.randn(c + q, HKV, D, generator=g).to(dtype)
        cache.write(0, slots, keys, values)
        slot_rows.append(slots[c:])
    meta = AttentionMetadata.build(
        list(query_lens), list(context_lens), torch.cat(slot_rows),
        cache.block_table(list(range(len(query_lens)))), block_size, torch.device("cpu"),
    )
    query = torch.randn(sum(query_lens), H, D, generator=g).to(dtype)
    return cache, meta, query


def run(backend, cache, meta, query):
    return backend.forward(query, cache.key[0], cache.value[0], meta, backend.prepare(meta), D**-0.5)


CASES = [
    ([0], [7]),  # prefill of one sequence
    ([9], [1]),  # batch-1 decode (the no-mask fast path)
    ([9, 0, 30], [1, 5, 1]),  # mixed decode / prefill
    ([12, 3, 20, 5], [5, 5, 2, 1]),  # verify-shaped batch with different k
]


@pytest.mark.parametrize("context_lens,query_lens", CASES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_sdpa_matches_reference(context_lens, query_lens, block_size):
    cache, meta, query = random_batch(context_lens, query_lens, block_size)
    got = run(SdpaAttention(torch.float32), cache, meta, query)
    want = run(ReferenceAttention(), cache, meta, query)
    assert (got - want).abs().max().item() < 1e-5


def test_sdpa_bf16_close_to_reference():
    cache, meta, query = random_batch([12, 3], [5, 2], 4, dtype=torch.bfloat16)
    got = run(SdpaAttention(torch.bfloat16), cache, meta, query).float()
    want = run(ReferenceAttention(), cache, meta, query).float()
    assert (got - want).abs().max().item() < 0.05


class FlashStandIn:
    """Has flash-attn's two functions and checks their argument contract, computing with the reference.

    The checks are the ones the real kernels make: int32 cu_seqlens / block
    tables / cache lengths, page size a multiple of 256, q of shape
    [tokens, H, D] (varlen) or [B, 1, H, D] (kvcache), causal, and cu offsets that
    agree with the block tables.
    """

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _check_cache(self, k_cache, v_cache, block_table):
        assert k_cache.shape == v_cache.shape and k_cache.shape[1] % 256 == 0
        assert block_table.dtype == torch.int32 and block_table.dim() == 2

    def _reference(self, q, k_cache, v_cache, context_lens, query_lens, block_table, scale):
        meta = AttentionMetadata.build(query_lens, context_lens, torch.zeros(sum(query_lens), dtype=torch.int64),
                                       block_table, k_cache.shape[1], q.device)
        return ReferenceAttention().forward(q, k_cache, v_cache, meta, None, scale)

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=False, block_table=None, **unused):
        self.calls.append("varlen")
        assert causal and not unused and block_table is not None
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        self._check_cache(k, v, block_table)
        query_lens = cu_seqlens_q.diff().tolist()
        seq_lens = cu_seqlens_k.diff().tolist()
        assert q.shape[0] == cu_seqlens_q[-1] and max_seqlen_q == max(query_lens) and max_seqlen_k == max(seq_lens)
        context = [s - n for s, n in zip(seq_lens, query_lens)]
        return self._reference(q, k, v, context, query_lens, block_table, softmax_scale)

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                                softmax_scale=None, causal=False, **unused):
        self.calls.append("kvcache")
        assert causal and not unused and q.dim() == 4 and q.shape[1] == 1
        assert cache_seqlens.dtype == torch.int32
        self._check_cache(k_cache, v_cache, block_table)
        seq_lens = cache_seqlens.tolist()
        out = self._reference(q[:, 0], k_cache, v_cache, [s - 1 for s in seq_lens], [1] * len(seq_lens),
                              block_table, softmax_scale)
        return out[:, None]


@pytest.mark.parametrize("context_lens,query_lens", CASES)
def test_flash_plumbing_matches_reference(context_lens, query_lens):
    cache, meta, query = random_batch([c * 40 for c in context_lens], query_lens, 256)
    stand_in = FlashStandIn()
    got = run(FlashAttention(256, flash_module=stand_in), cache, meta, query)
    want = run(ReferenceAttention(), cache, meta, query)
    assert torch.allclose(got, want, atol=1e-6)
    assert stand_in.calls == ["kvcache" if meta.is_decode_only else "varlen"]


def test_flash_refuses_small_pages():
    with pytest.raises(ValueError, match="multiple of 256"):
        FlashAttention(16, flash_module=types.SimpleNamespace())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and flash-attn")
def test_real_flash_kernel_matches_reference():  # pragma: no cover - runs on GPU machines only
    flash_attn = pytest.importorskip("flash_attn")
    cache, meta, query = random_batch([300, 10], [5, 1], 256, dtype=torch.bfloat16)
    cache.key, cache.value = cache.key.cuda(), cache.value.cuda()
    meta_cuda = AttentionMetadata.build(meta.query_lens, meta.context_lens, meta.slot_mapping, meta.block_tables,
                                        256, torch.device("cuda"))
    got = FlashAttention(256, flash_attn).forward(query.cuda(), cache.key[0], cache.value[0], meta_cuda, None, D**-0.5)
    want = run(ReferenceAttention(), cache, meta, query)
    assert (got.cpu().float() - want.float()).abs().max().item() < 0.05


@pytest.mark.parametrize("onednn", [True, False], ids=["oneDNN-on", "oneDNN-off"])
def test_sdpa_bf16_token_is_bitwise_the_same_decoded_verified_or_batched(onednn, monkeypatch):
    """The attention half of the bf16 promise, on Qwen2-0.5B's head layout (14 query heads on 2 KV heads).

    With oneDNN on or off (RowStableLinear turns it off for the process; SDPA's inner matmuls follow).
    """
    heads, kv_heads, dim, block = 14, 2, 64, 16
    g = torch.Generator().manual_seed(5)
    cache = PagedKVCache(1, 32, block, kv_heads, dim, torch.bfloat16)
    lens = {"a": 105, "b": 43, "c": 60}
    slots = cache.append_slots(lens)
    for seq, n in lens.items():
        kv = torch.randn(2, n, kv_heads, dim, generator=g).to(torch.bfloat16)
        cache.write(0, slots[seq], kv[0], kv[1])
    queries = {s: torch.randn(n, heads, dim, generator=g).to(torch.bfloat16) for s, n in lens.items()}
    backend = SdpaAttention(torch.bfloat16)

    def attend(runs: list[tuple[str, int, int]]) -> torch.Tensor:  # (sequence, context, new tokens) each
        meta = AttentionMetadata.build(
            [q for _, _, q in runs], [c for _, c, _ in runs],
            torch.cat([slots[s][c : c + q] for s, c, q in runs]),
            cache.block_table([s for s, _, _ in runs]), block, torch.device("cpu"),
        )
        query = torch.cat([queries[s][c : c + q] for s, c, q in runs])
        return backend.forward(query, cache.key[0], cache.value[0], meta, backend.prepare(meta), dim**-0.5)

    monkeypatch.setattr(torch.backends.mkldnn, "enabled", onednn)
    decoded = torch.cat([attend([("a", 100 + i, 1)]) for i in range(5)])  # [5, H, D]
    verified = attend([("a", 100, 5)])
    batched = attend([("b", 40, 3), ("a", 100, 5), ("c", 40, 20)])[3:8]
    assert torch.equal(verified, decoded)
    assert torch.equal(batched, decoded)
