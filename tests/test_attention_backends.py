"""SDPA and flash-attn plumbing against the slow reference, on random paged ragged batches."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from tandem.attention import sdpa
from tandem.attention.base import AttentionMetadata
from tandem.attention.flash import FlashAttention
from tandem.attention.reference import ReferenceAttention
from tandem.attention.sdpa import PIECE, SdpaAttention, batch_short_runs
from tandem.kv_cache import PagedKVCache
from tandem.tree_rows import path_to

H, HKV, D = 4, 2, 16


def random_batch(context_lens, query_lens, block_size, dtype=torch.float32, seed=0, tree_parents=None):
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
        cache.block_table(list(range(len(query_lens)))), block_size, torch.device("cpu"), tree_parents,
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
        """q ``[B, q, H, D]``: each sequence's last q cached tokens are its new ones (the causal mask aligned
        bottom-right, as the kernel's is)."""
        self.calls.append("kvcache")
        assert causal and not unused and q.dim() == 4
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (q.shape[0],)
        self._check_cache(k_cache, v_cache, block_table)
        batch, query_len = q.shape[:2]
        seq_lens = cache_seqlens.tolist()
        out = self._reference(q.reshape(batch * query_len, *q.shape[2:]), k_cache, v_cache,
                              [s - query_len for s in seq_lens], [query_len] * batch, block_table, softmax_scale)
        return out.view(q.shape)


@pytest.mark.parametrize("context_lens,query_lens", CASES)
def test_flash_plumbing_matches_reference(context_lens, query_lens):
    cache, meta, query = random_batch([c * 40 for c in context_lens], query_lens, 256)
    stand_in = FlashStandIn()
    got = run(FlashAttention(256, flash_module=stand_in), cache, meta, query)
    want = run(ReferenceAttention(), cache, meta, query)
    assert torch.allclose(got, want, atol=1e-6)
    assert stand_in.calls == ["kvcache" if meta.is_decode_only else "varlen"]


def test_flash_computes_a_batch_with_a_tree_through_sdpa():
    """flash-attn takes no custom mask: a batch holding a tree goes through the SDPA math, chains do not."""
    context_lens, query_lens = [400, 300, 10], [1, len(TREE), 5]
    cache, meta, query = random_batch(context_lens, query_lens, 256, tree_parents=[None, TREE, None])
    stand_in = FlashStandIn()
    backend = FlashAttention(256, flash_module=stand_in, dtype=torch.float32)
    got = run(backend, cache, meta, query)
    want = run(ReferenceAttention(), cache, meta, query)
    assert (got - want).abs().max().item() < 1e-5
    assert torch.equal(got, run(SdpaAttention(torch.float32), cache, meta, query))
    assert stand_in.calls == []
    # The same batch as chains keeps the kernel.
    _, chain_meta, _ = random_batch(context_lens, query_lens, 256)
    run(backend, cache, chain_meta, query)
    assert stand_in.calls == ["varlen"]


def test_auto_picks_flash_on_cuda_only_for_what_its_kernels_take(monkeypatch):
    """flash-attn runs fp16 and bf16 on pages of 256 tokens; fp32 ("FlashAttention only support fp16 and bf16")
    and smaller pages stay on SDPA."""
    from tandem.attention import make_backend

    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # installed, as on a GPU
    cuda = torch.device("cuda")
    for dtype in (torch.bfloat16, torch.float16):
        assert isinstance(make_backend("auto", dtype, cuda, 256), FlashAttention)
    assert isinstance(make_backend("auto", torch.float32, cuda, 256), SdpaAttention)
    assert isinstance(make_backend("auto", torch.bfloat16, cuda, 16), SdpaAttention)
    assert isinstance(make_backend("auto", torch.bfloat16, torch.device("cpu"), 256), SdpaAttention)


class _BrokenFlash:
    """A meta path finder for an installed flash-attn built against another torch: its import fails as such."""

    def find_spec(self, name, path=None, target=None):
        if name == "flash_attn":
            raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")
        return None


def test_a_flash_attn_that_cannot_load_is_named_and_sdpa_serves(monkeypatch, caplog):
    from tandem.attention import make_backend

    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenFlash(), *sys.meta_path])
    with caplog.at_level("WARNING", logger="tandem.attention"):
        backend = make_backend("auto", torch.bfloat16, torch.device("cuda"), 256)
    assert isinstance(backend, SdpaAttention)
    assert "flash-attn is installed but cannot load" in caplog.text and "undefined symbol" in caplog.text
    caplog.clear()
    monkeypatch.setattr(sys, "meta_path", sys.meta_path[1:])  # not installed at all: SDPA, and nothing to say
    assert isinstance(make_backend("auto", torch.bfloat16, torch.device("cuda"), 256), SdpaAttention)
    assert "flash-attn" not in caplog.text


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_prompt_rows_are_bitwise_the_same_however_the_prompt_is_cut(dtype):
    """A prompt computed in one run, in chunks of any size (short ones too), or after a cached prefix of any
    length: each row bitwise the same, since prompt attention is fixed by position (tandem/attention/sdpa.py).
    The cuts include runs of 1..16 tokens, which would go row by row if they were not marked prompt runs."""
    heads, kv_heads, dim, block, length = 14, 2, 64, 16, 150
    g = torch.Generator().manual_seed(7)
    cache = PagedKVCache(1, 16, block, kv_heads, dim, dtype)
    slots = cache.append_slots({"p": length})["p"]
    kv = torch.randn(2, length, kv_heads, dim, generator=g).to(dtype)
    cache.write(0, slots, kv[0], kv[1])
    queries = torch.randn(length, heads, dim, generator=g).to(dtype)
    backend = SdpaAttention(dtype)

    def attend(start: int, stop: int, prompt: bool) -> torch.Tensor:  # [stop - start, H, D]
        meta = AttentionMetadata.build([stop - start], [start], slots[start:stop], cache.block_table(["p"]), block,
                                       torch.device("cpu"), prompt_runs=[prompt])
        return backend.forward(queries[start:stop], cache.key[0], cache.value[0], meta, backend.prepare(meta),
                               dim**-0.5)

    whole = attend(0, length, True)
    for cuts in ([0, 1, 2, 5, 17, 40, 41, 100, 150], [0, 7, 16, 33, 64, 65, 150], [0, 149, 150], [0, 9, 150]):
        pieces = torch.cat([attend(a, b, True) for a, b in zip(cuts, cuts[1:])])
        assert torch.equal(pieces, whole), cuts
    # Unmarked, a short run goes row by row (the decode path): a different reduction, so the mark matters.
    assert attend(40, 45, False).shape == (5, heads, dim)
    with pytest.raises(ValueError, match="a prompt run cannot be a speculation tree"):
        AttentionMetadata.build([2], [3], slots[3:5], cache.block_table(["p"]), block, torch.device("cpu"),
                                tree_parents=[[-1, -1]], prompt_runs=[True])



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_s_pieces_that_read_the_same_keys_share_a_call_and_keep_their_rows(dtype, monkeypatch):
    """On a CPU a prompt's consecutive pieces of one key count go in one call (keys expanded along the batch
    axis), each with its own staircase: the rows are bitwise those of a call per piece, the calls per layer one
    per KEY_STEP of keys (SmolLM2's head layout; a run starting and ending inside a piece)."""
    heads, kv_heads, dim, block, start, stop = 9, 3, 64, 16, 2, 147
    g = torch.Generator().manual_seed(11)
    cache = PagedKVCache(1, 16, block, kv_heads, dim, dtype)
    slots = cache.append_slots({"p": stop})["p"]
    kv = torch.randn(2, stop, kv_heads, dim, generator=g).to(dtype)
    cache.write(0, slots, kv[0], kv[1])
    queries = torch.randn(stop - start, heads, dim, generator=g).to(dtype)
    backend = SdpaAttention(dtype)
    meta = AttentionMetadata.build([stop - start], [start], slots[start:stop], cache.block_table(["p"]), block,
                                   torch.device("cpu"), prompt_runs=[True])
    calls = []  # (pieces in the call, keys each reads)
    attend = sdpa.F.scaled_dot_product_attention

    def counted(query, key, value, **kwargs):
        calls.append((query.shape[0], key.shape[2]))
        return attend(query, key, value, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", counted)
    state = backend.prepare(meta)
    assert state.batched  # a CPU
    shared = backend.forward(queries, cache.key[0], cache.value[0], meta, state, dim**-0.5)
    # pieces ending at 4..148 (37): eight per KEY_STEP (32 keys), the last five reading 160
    assert calls == [(8, 32), (8, 64), (8, 96), (8, 128), (5, 160)]
    calls.clear()
    alone = backend.forward(queries, cache.key[0], cache.value[0], meta,
                            dataclasses.replace(backend.prepare(meta), batched=False), dim**-0.5)
    assert len(calls) == 37 and {pieces for pieces, _ in calls} == {1}
    assert torch.equal(shared, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_runs_of_many_sequences_share_calls_and_keep_their_prompt_rows(dtype):
    """Decode rows and short verified chains of many sequences, batched by the keys their pieces read (one call
    per key count), beside a long prompt run and a tree: every row bitwise the row its sequence's prompt computes
    at that position, alone, as in the module doc's promise (SmolLM2's head layout: 9 query heads on 3 KV heads)."""
    heads, kv_heads, dim, block = 9, 3, 64, 4
    g = torch.Generator().manual_seed(3)
    cache = PagedKVCache(1, 256, block, kv_heads, dim, dtype)
    # (context, new tokens): decode rows in pieces ending at 44, 48, 64 (their calls read 64 keys: KEY_STEP 32)
    # and 68 (96 keys), chains of 5 across two pieces, a chain of 2 inside one, and a long prompt run (ten pieces,
    # a call per piece of its own)
    runs = {"d40": (40, 1), "d41": (41, 1), "d42": (42, 1), "d43": (43, 1), "d44": (44, 1), "d46": (46, 1),
            "v42": (42, 5), "v45": (45, 2), "d62": (62, 1), "d64": (64, 1), "v62": (62, 5), "prompt": (3, 37)}
    lens = {s: c + q for s, (c, q) in runs.items()} | {"tree": 30 + len(TREE)}
    slots = cache.append_slots(lens)
    for seq, n in lens.items():
        kv = torch.randn(2, n, kv_heads, dim, generator=g).to(dtype)
        cache.write(0, slots[seq], kv[0], kv[1])
    queries = {s: torch.randn(n, heads, dim, generator=g).to(dtype) for s, n in lens.items()}
    backend = SdpaAttention(dtype)

    def metadata(batch: list[tuple[str, int, int]], prompt: bool = False) -> AttentionMetadata:
        return AttentionMetadata.build(
            [q for _, _, q in batch], [c for _, c, _ in batch], torch.cat([slots[s][c : c + q] for s, c, q in batch]),
            cache.block_table([s for s, _, _ in batch]), block, torch.device("cpu"),
            [TREE if s == "tree" else None for s, _, _ in batch], [prompt] * len(batch))

    def attend(batch: list[tuple[str, int, int]], prompt: bool = False) -> torch.Tensor:
        meta = metadata(batch, prompt)
        query = torch.cat([queries[s][c : c + q] for s, c, q in batch])
        return backend.forward(query, cache.key[0], cache.value[0], meta, backend.prepare(meta), dim**-0.5)

    batch = [(s, c, q) for s, (c, q) in runs.items()] + [("tree", 30, len(TREE))]
    state = backend.prepare(metadata(batch))
    calls = {b.keys: sorted(b.ends) for b in state.piece_batches}
    # 64 keys: d40-d43, v42's first piece, d44, d46, v42's second, v45, d62, v62's first; 96 keys: d64, v62's second
    assert calls == {64: [44] * 5 + [48] * 4 + [64] * 2, 96: [68, 68]}
    assert state.long_runs == [(11, 20)] and set(state.tree_gathers) == {12}
    mixed = attend(batch)
    token = 0
    for seq, context, new in batch:
        if seq != "tree":
            as_prompt = attend([(seq, 0, context + new)], prompt=True)[context:]  # the same rows, by position
            assert torch.equal(mixed[token : token + new], as_prompt), seq
        token += new
    assert torch.equal(mixed[-len(TREE):], attend([("tree", 30, len(TREE))]))


def test_short_runs_share_calls_on_a_cpu_with_other_sequences_only_and_calls_gather_a_bounded_count(monkeypatch):
    """Elsewhere a kernel's split of its work may follow the batch (sdpa.py's module doc): every run alone there.
    A run that shares no key count with another sequence goes alone too (no index copies for a lone stream)."""
    cache, meta, _ = random_batch([9, 10, 30, 0, 70], [1, 1, 5, 40, 1], 4)
    kv_gather = SdpaAttention(torch.float32).prepare(meta).kv_gather
    batches, long_runs = batch_short_runs(meta, kv_gather, batched=True)
    # Keys read in steps of KEY_STEP (32): pieces ending at 12, 12 and 32 share a call, the one ending at 36 (the
    # second piece of sequence 2's run) reads 64; sequence 4's row, ending at 72 (96 keys), shares with nobody.
    assert [(b.keys, b.ends) for b in batches] == [(32, [12, 12, 32]), (64, [36])]
    assert long_runs == [(3, 7), (4, 47)]
    assert batches[0].tokens.tolist() == [0, 1, 2, 3] and batches[0].places.tolist() == [1, PIECE + 2, 10, 11]
    batches, long_runs = batch_short_runs(meta, kv_gather, batched=False)
    assert batches == [] and long_runs == [(0, 0), (1, 1), (2, 2), (3, 7), (4, 47)]
    monkeypatch.setattr(sdpa, "MAX_GATHERED_KEYS", 64)  # two pieces of 32 keys a call
    batches, _ = batch_short_runs(meta, kv_gather, batched=True)
    assert [(b.keys, b.ends) for b in batches] == [(32, [12, 12]), (32, [32]), (64, [36])]

# ----- speculation trees ------------------------------------------------------------
#  0 - 1 - 2 - 3
#  |   `-- 9 - 10
#  `-- 4 - 5 - 6 - 7 - 8
TREE = [-1, 0, 1, 2, 0, 4, 5, 6, 7, 1, 9]
LEAVES = [3, 8, 10]


@pytest.mark.parametrize("block_size", [4, 16])
def test_sdpa_tree_matches_reference(block_size):
    cache, meta, query = random_batch([9, 13, 0, 30], [1, len(TREE), 5, 20], block_size,
                                      tree_parents=[None, TREE, None, None])
    got = run(SdpaAttention(torch.float32), cache, meta, query)
    want = run(ReferenceAttention(), cache, meta, query)
    assert (got - want).abs().max().item() < 1e-5


def test_reference_tree_row_sees_only_its_path():
    """The oracle itself: a tree row equals softmax attention over context + path, computed by hand."""
    ctx = 6
    cache, meta, query = random_batch([ctx], [len(TREE)], 4, tree_parents=[TREE])
    got = run(ReferenceAttention(), cache, meta, query)
    slots = cache.slots(0, list(range(ctx + len(TREE))))
    keys, values = cache.key[0].view(-1, HKV, D)[slots], cache.value[0].view(-1, HKV, D)[slots]  # [ctx + q, Hkv, D]
    row = 7  # path 0, 4, 5, 6, 7
    seen = [*range(ctx), *(ctx + r for r in path_to(TREE, row))]
    for h in range(H):
        probs = torch.softmax(keys[seen, h // (H // HKV)] @ query[row, h] * D**-0.5, dim=0)
        torch.testing.assert_close(got[row, h], probs @ values[seen, h // (H // HKV)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_tree_rows_are_bitwise_the_rows_of_a_chain_of_their_path(dtype):
    """Each root-to-leaf path of a tree, batched among decode, verify and prefill sequences, gives
    bitwise what a chain of that path alone gives, with the same K/V and queries."""
    ctx, block = 21, 4
    g = torch.Generator().manual_seed(11)
    cache = PagedKVCache(1, 128, block, HKV, D, dtype)
    backend = SdpaAttention(dtype)
    others = {"decode": (30, 1), "verify": (12, 5), "prefill": (8, 20)}  # (context, new tokens)
    lens = {"tree": ctx + len(TREE), **{s: c + q for s, (c, q) in others.items()}}
    slots = cache.append_slots(lens)
    for seq, n in lens.items():
        kv = torch.randn(2, n, HKV, D, generator=g).to(dtype)
        cache.write(0, slots[seq], kv[0], kv[1])
    tree_query = torch.randn(len(TREE), H, D, generator=g).to(dtype)
    other_query = {s: torch.randn(q, H, D, generator=g).to(dtype) for s, (_, q) in others.items()}

    def attend(runs):  # (sequence, context, new-token slots, queries, parents or None) each
        meta = AttentionMetadata.build(
            [len(s) for _, _, s, _, _ in runs], [c for _, c, _, _, _ in runs], torch.cat([s for _, _, s, _, _ in runs]),
            cache.block_table([seq for seq, *_ in runs]), block, torch.device("cpu"), [p for *_, p in runs],
        )
        query = torch.cat([q for _, _, _, q, _ in runs])
        return backend.forward(query, cache.key[0], cache.value[0], meta, backend.prepare(meta), D**-0.5)

    mixed = attend([
        ("decode", 30, slots["decode"][30:], other_query["decode"], None),
        ("tree", ctx, slots["tree"][ctx:], tree_query, TREE),
        ("verify", 12, slots["verify"][12:], other_query["verify"], None),
        ("prefill", 8, slots["prefill"][8:], other_query["prefill"], None),
    ])
    tree_rows = mixed[1 : 1 + len(TREE)]
    alone = attend([("tree", ctx, slots["tree"][ctx:], tree_query, TREE)])
    assert torch.equal(alone, tree_rows)
    for leaf in LEAVES:
        path = path_to(TREE, leaf)
        chain = f"chain-{leaf}"
        chain_slots = cache.append_slots({chain: ctx + len(path)})[chain]
        flat_k, flat_v = cache.key[0].view(-1, HKV, D), cache.value[0].view(-1, HKV, D)
        source = torch.cat([slots["tree"][:ctx], slots["tree"][ctx + torch.tensor(path)]])
        cache.write(0, chain_slots, flat_k[source].clone(), flat_v[source].clone())
        got = attend([(chain, ctx, chain_slots[ctx:], tree_query[path], None)])  # [len(path), H, D]
        assert torch.equal(tree_rows[path], got), f"path {path}"
    # The chains in the mixed batch are untouched by the tree next to them.
    assert torch.equal(mixed[:1], attend([("decode", 30, slots["decode"][30:], other_query["decode"], None)]))
    verify = attend([("verify", 12, slots["verify"][12:], other_query["verify"], None)])
    assert torch.equal(mixed[1 + len(TREE) : 6 + len(TREE)], verify)


def test_tree_metadata_is_validated():
    cache, meta, _ = random_batch([3], [4], 4)
    with pytest.raises(ValueError, match=r"sequence 0 of the batch: parents\[2\] = 2 is outside -1..1"):
        AttentionMetadata.build([4], [3], meta.slot_mapping, meta.block_tables, 4, torch.device("cpu"),
                                [[-1, 0, 2, 0]])
    with pytest.raises(ValueError, match="describes 2 sequences, the batch has 1"):
        AttentionMetadata.build([4], [3], meta.slot_mapping, meta.block_tables, 4, torch.device("cpu"),
                                [None, None])
    tree = [-1, *([0] * 16)]  # 17 tokens: too many for row-by-row attention
    cache, meta, _ = random_batch([3], [17], 4, tree_parents=[tree])
    with pytest.raises(ValueError, match="a tree of 17 new tokens: at most 16"):
        SdpaAttention(torch.float32).prepare(meta)
