"""Speculation trees through the engine: every path of a tree forward is a chain forward of that path,
and ``keep_path`` leaves the KV of the accepted path as if only it had been fed.

bf16 is bitwise throughout: tree rows go through the same row-by-row attention calls as a chain's
rows (see tests/test_attention_backends.py, bitwise in fp32 too) and through the row-invariant
linear layers. fp32 linear layers go through MKL, whose sgemm rounds a row differently with the
number of rows in the call (RowStableLinear makes no fp32 promise): a tree of 11 rows and a
chain of 4 differ by about 3e-6 in fp32, so fp32 compares within 1e-4 as the other engine tests do.
"""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine import ForwardItem, ModelEngine, tree_parents_of
from tandem.errors import UnknownSequenceError
from tandem.tree_rows import depths, is_chain, path_to

#  0 - 1 - 2 - 3
#  |   `-- 9 - 10
#  `-- 4 - 5 - 6 - 7 - 8
TREE = [-1, 0, 1, 2, 0, 4, 5, 6, 7, 1, 9]
TREE_TOKENS = [10, 11, 12, 13, 20, 21, 22, 23, 24, 30, 31]
LEAVES = [3, 8, 10]
CONTEXT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]  # 13: blocks of 4 end mid-block


@pytest.fixture(params=["float32", "bfloat16"])
def engine(request, tiny_qwen2_dir) -> ModelEngine:
    return ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype=request.param, kv_cache_tokens=1024, block_size=4))


def assert_same(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:  # the tiny model's layers are too small to pack (MIN_PACKED_ELEMENTS): MKL, no bitwise promise
        assert (got - want).abs().max().item() <= 1e-4


def tree_item(seq: str) -> ForwardItem:
    return ForwardItem(seq, TREE_TOKENS, num_logits=len(TREE), parents=TREE)


def chain_logits(engine: ModelEngine, seq: str, path: list[int]) -> torch.Tensor:  # [len(path), vocab]
    """A fresh sequence with the same context, fed the path as a chain; released afterwards."""
    engine.forward([ForwardItem(seq, CONTEXT, num_logits=0)])
    logits = engine.forward([ForwardItem(seq, [TREE_TOKENS[r] for r in path], num_logits=len(path))])[0]
    engine.release(seq)
    return logits


def kv_of(engine: ModelEngine, seq: str) -> tuple[torch.Tensor, torch.Tensor]:  # [L, len, Hkv, D] each
    cache = engine.kv_cache
    slots = cache.slots(seq, list(range(cache.length(seq))))
    flat = (pool.view(pool.shape[0], -1, *pool.shape[-2:]) for pool in (cache.key, cache.value))
    return tuple(f[:, slots].clone() for f in flat)


def test_every_path_of_a_tree_is_a_chain_forward_of_that_path(engine):
    engine.forward([ForwardItem("t", CONTEXT, num_logits=0)])
    tree = engine.forward([tree_item("t")])[0]  # [11, vocab]
    assert engine.seq_len("t") == len(CONTEXT) + len(TREE)  # every node's KV is held until keep_path
    for leaf in LEAVES:
        path = path_to(TREE, leaf)
        assert_same(tree[path], chain_logits(engine, "chain", path), engine.dtype)


def test_a_tree_among_decode_verify_and_prefill_sequences(engine):
    """Batch invariance: the tree's paths and its neighbours' rows are what each computes alone."""
    others = {"d": ([60, 61, 62], [63]), "v": (list(range(20, 32)), [70, 71, 72, 73, 74]),
              "p": ([5, 6], list(range(30, 50)))}  # (cached, new): decode, verify, a 20-token prefill chunk
    for seq, (cached, _) in others.items():
        engine.forward([ForwardItem(seq, cached, num_logits=0)])
    engine.forward([ForwardItem("t", CONTEXT, num_logits=0)])
    d, tree, v, p = engine.forward([
        ForwardItem("d", others["d"][1]), tree_item("t"),
        ForwardItem("v", others["v"][1], num_logits=5), ForwardItem("p", others["p"][1], num_logits=20),
    ])
    for leaf in LEAVES:
        path = path_to(TREE, leaf)
        assert_same(tree[path], chain_logits(engine, "chain", path), engine.dtype)
    for seq, got in (("d", d), ("v", v), ("p", p)):
        cached, new = others[seq]
        engine.forward([ForwardItem(f"solo-{seq}", cached, num_logits=0)])
        assert_same(got, engine.forward([ForwardItem(f"solo-{seq}", new, num_logits=len(new))])[0], engine.dtype)


def test_tree_forward_matches_the_reference_backend(tiny_qwen2_dir):
    logits = {}
    for backend in ("sdpa", "reference"):
        engine = ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype="float32", kv_cache_tokens=1024, block_size=4,
                                               attention_backend=backend))
        engine.forward([ForwardItem("t", CONTEXT, num_logits=0), ForwardItem("d", [7, 8, 9], num_logits=0)])
        logits[backend] = engine.forward([ForwardItem("d", [10]), tree_item("t")])
    for got, want in zip(logits["sdpa"], logits["reference"]):
        assert (got - want).abs().max().item() < 1e-4


def test_tree_rows_helpers():
    assert [path_to(TREE, leaf) for leaf in LEAVES] == [[0, 1, 2, 3], [0, 4, 5, 6, 7, 8], [0, 1, 9, 10]]
    assert path_to([-1, -1, 1], 2) == [1, 2]  # a second root: its path starts at itself
    assert is_chain([-1, 0, 1]) and is_chain([]) and not is_chain(TREE) and not is_chain([-1, -1])


def test_tree_positions_are_context_plus_depth():
    item = tree_item("t")
    assert item.positions(13).tolist() == [13 + d for d in depths(TREE)]
    assert depths(TREE) == [0, 1, 2, 3, 1, 2, 3, 4, 5, 2, 3]
    assert ForwardItem("c", [1, 2, 3]).positions(5).tolist() == [5, 6, 7]
    assert ForwardItem("c", [1, 2, 3], parents=[-1, 0, 1]).positions(5).tolist() == [5, 6, 7]


def test_flat_parents_give_trees_per_sequence_and_none_for_chains():
    parents = torch.tensor([-1, -1, 0, 1, *TREE, -1, 0], dtype=torch.int64)
    assert tree_parents_of(parents, [1, 3, len(TREE), 2]) == [None, None, TREE, None]
    assert tree_parents_of(torch.tensor([-1, -1, 0]), [1, 2]) == [None, None]
    # Two roots (both follow the context) is a tree too, though every row's parent is in range.
    assert tree_parents_of(torch.tensor([-1, -1, 0]), [3]) == [[-1, -1, 0]]


# ----- keep_path --------------------------------------------------------------------

def test_keep_path_leaves_the_kv_of_a_chain_of_the_path(engine):
    base = len(CONTEXT)
    path = [0, 4, 5, 6]  # rows 4, 5, 6 sit at depths 1, 2, 3: three of them move
    engine.forward([ForwardItem("t", CONTEXT, num_logits=0)])
    engine.forward([tree_item("t")])
    tree_k, tree_v = kv_of(engine, "t")
    engine.keep_path("t", base, path)
    assert engine.seq_len("t") == base + len(path)
    kept_k, kept_v = kv_of(engine, "t")
    # The copy itself is exact in any dtype: each path row's K/V now sits at its depth.
    rows = [*range(base), *(base + r for r in path)]
    assert torch.equal(kept_k, tree_k[:, rows]) and torch.equal(kept_v, tree_v[:, rows])

    engine.forward([ForwardItem("c", CONTEXT, num_logits=0)])
    engine.forward([ForwardItem("c", [TREE_TOKENS[r] for r in path], num_logits=0)])
    chain_k, chain_v = kv_of(engine, "c")
    assert torch.equal(kept_k[:, :base], chain_k[:, :base])  # the context's prefill is the same call
    assert_same(kept_k, chain_k, engine.dtype)
    assert_same(kept_v, chain_v, engine.dtype)
    after_tree = engine.forward([ForwardItem("t", [77], num_logits=1)])[0]
    after_chain = engine.forward([ForwardItem("c", [77], num_logits=1)])[0]
    assert_same(after_tree, after_chain, engine.dtype)
    # A mismatch would show: the tree's row 1 (at depth 1 before the move) is another token's K/V.
    assert not torch.equal(tree_k[:, base + 1], tree_k[:, base + 4])


def test_keep_path_of_the_root_or_of_nothing_moves_nothing(engine, monkeypatch):
    base = len(CONTEXT)
    moves = []
    monkeypatch.setattr(engine, "move_kv", lambda src, dst: moves.append((src, dst)))
    engine.forward([ForwardItem("t", CONTEXT, num_logits=0)])
    engine.forward([tree_item("t")])
    engine.keep_path("t", base, [0])
    assert engine.seq_len("t") == base + 1 and moves == []
    after_root = engine.forward([ForwardItem("t", [77])])[0]
    engine.forward([ForwardItem("c", CONTEXT, num_logits=0)])
    engine.forward([ForwardItem("c", TREE_TOKENS[:1], num_logits=0)])
    assert_same(after_root, engine.forward([ForwardItem("c", [77])])[0], engine.dtype)

    engine.forward([tree_item("t")])
    engine.keep_path("t", base + 2, [0, 1, 2, 3])  # a chain path of a tree: already in place
    assert engine.seq_len("t") == base + 6 and moves == []
    engine.keep_path("t", base + 2, [])  # nothing accepted: back to where the tree started
    assert engine.seq_len("t") == base + 2 and moves == []


def test_invalid_keep_path_raises_and_changes_nothing(engine):
    base = len(CONTEXT)
    engine.forward([ForwardItem("t", CONTEXT, num_logits=0)])
    engine.forward([tree_item("t")])
    before = kv_of(engine, "t")
    with pytest.raises(ValueError, match="path rows \\[0, 5, 4\\] are not increasing"):
        engine.keep_path("t", base, [0, 5, 4])
    with pytest.raises(ValueError, match="path rows \\[0, 11\\] outside the 11 tokens after 13"):
        engine.keep_path("t", base, [0, 11])
    with pytest.raises(ValueError, match="holds 24 tokens: base_len 25 is outside 0..24"):
        engine.keep_path("t", 25, [])
    with pytest.raises(UnknownSequenceError):
        engine.keep_path("nope", 0, [0])
    assert engine.seq_len("t") == base + len(TREE)
    after = kv_of(engine, "t")
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


# ----- ForwardItem validation -------------------------------------------------------

@pytest.mark.parametrize("parents,message", [
    ([-1, 0], "sequence 's': 2 parents for 3 new tokens"),
    ([-1, 0, 2], r"sequence 's': parents\[2\] = 2 is outside -1..1"),
    ([-1, -2, 0], r"sequence 's': parents\[1\] = -2 is outside -1..0"),
    ([0, 0, 0], r"sequence 's': parents\[0\] = 0 is outside -1..-1"),
])
def test_forward_item_refuses_parents_that_are_not_a_tree_in_order(parents, message):
    with pytest.raises(ValueError, match=message):
        ForwardItem("s", [1, 2, 3], parents=parents)


def test_forward_item_trees_are_at_most_the_row_wise_limit():
    ForwardItem("s", list(range(16)), parents=[-1, *([0] * 15)])  # 16: fine
    with pytest.raises(ValueError, match="sequence 's': a tree of 17 tokens, at most 16"):
        ForwardItem("s", list(range(17)), parents=[-1, *([0] * 16)])
    long_chain = ForwardItem("s", list(range(40)), num_logits=40, parents=list(range(-1, 39)))
    assert not long_chain.is_tree  # a chain spelled out is no tree, whatever its length


@pytest.mark.slow
def test_smollm2_bf16_tree_paths_are_bitwise_chains_and_keep_path_is_exact(smollm2_dir):
    """The promise on a real model, whose matmuls are large enough to switch kernels with the row count."""
    engine = ModelEngine.load(EngineConfig(smollm2_dir, dtype="bfloat16", kv_cache_tokens=1024))
    tokens = [1500 + t for t in TREE_TOKENS]
    context = list(range(1000, 1040))
    engine.forward([ForwardItem("t", context, num_logits=0)])
    tree = engine.forward([ForwardItem("t", tokens, num_logits=len(TREE), parents=TREE),
                           ForwardItem("d", [5, 6, 7])])[0]
    for leaf in LEAVES:
        path = path_to(TREE, leaf)
        engine.forward([ForwardItem("c", context, num_logits=0)])
        chain = engine.forward([ForwardItem("c", [tokens[r] for r in path], num_logits=len(path))])[0]
        assert torch.equal(tree[path], chain), f"path {path}"
        engine.release("c")
    path = path_to(TREE, 6)  # [0, 4, 5, 6]
    engine.keep_path("t", len(context), path)
    engine.forward([ForwardItem("c", context, num_logits=0)])  # the same calls as "t" minus the other branches
    engine.forward([ForwardItem("c", [tokens[r] for r in path], num_logits=0)])
    assert torch.equal(kv_of(engine, "t")[0], kv_of(engine, "c")[0])
    assert torch.equal(engine.forward([ForwardItem("t", [9])])[0], engine.forward([ForwardItem("c", [9])])[0])
