"""The prefix cache holds generated tokens' blocks too: a conversation's next turn reuses the answer it sends back.

The rules (docs/DESIGN.md, "Prefix caching"): only committed tokens whose KV is in place are offered, so a rejected
draft never reaches a cached block; every cached block holds what a prompt of its tokens computes; greedy output
with the cache on equals it off.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from draft_worker.engine import DraftEngine, ProposeCall
from tandem.block_pool import block_hash
from tandem.config import EngineConfig
from tandem.engine import ModelEngine
from tandem.inprocess import GenerationRequest, SpeculativeGenerator
from tandem.sampling import SamplingParams
from tandem.spec.options import SpecOptions
from target_worker.engine import PrefillCall, ReleaseCall, TargetEngine, VerifyCall
from tests.target_worker.test_engine import kv_of, ok

# Every engine here packs the tiny model's layers, so that its rows are fixed by position and its target caches
# generated tokens' blocks (an engine whose rows are not keeps prompt blocks only: the last test).
pytestmark = pytest.mark.usefixtures("every_linear_packed")

GREEDY = SamplingParams()
BLOCK = 4
FIRST = list(range(10, 33))  # 23 tokens: the first turn's prompt ends inside a block
FOLLOW_UP = [5, 6, 7, 8, 9, 5]  # what the next turn adds after the answer


def load(model_dir, caching: bool = True, dtype: str = "float32") -> ModelEngine:
    config = EngineConfig(model_dir, dtype=dtype, kv_cache_tokens=4096, block_size=BLOCK, prefix_caching=caching)
    if not config.pack_weights:
        pytest.skip(f"{dtype} weights are not packed on this CPU: its targets cache prompt blocks only")
    return ModelEngine.load(config)


def hash_chain(salt: bytes, tokens: Sequence[int]) -> list[bytes]:
    """The content hashes of the full blocks ``tokens`` begins with, in order, from a cache's ``salt``."""
    hashes, parent = [], salt
    for i in range(len(tokens) // BLOCK):
        parent = block_hash(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
        hashes.append(parent)
    return hashes


def chain_hashes(engine: ModelEngine, tokens: list[int]) -> list[bytes]:
    """The content hashes of the full blocks ``tokens`` begins with, in the engine's cache."""
    return hash_chain(engine.kv_cache.salt, tokens)


def registered(engine: ModelEngine) -> set[bytes]:
    return set(engine.kv_cache.pool._hash_of.values())


def converse(target: ModelEngine, method: str, draft: ModelEngine | None = None, tree: bool = False) -> list:
    """Two turns: the second prompt is the first, its answer and a follow-up."""
    options = {"tree": "on", "tree_width": 2} if tree else {}
    spec = SpecOptions(method, 4 if method != "none" else 0, adaptive_k=False, **options)
    generator = SpeculativeGenerator(target, draft, spec)
    (first,) = generator.generate([GenerationRequest(FIRST, max_new_tokens=30, sampling=GREEDY)])
    second_prompt = [*FIRST, *first.token_ids, *FOLLOW_UP]
    (second,) = generator.generate([GenerationRequest(second_prompt, max_new_tokens=20, sampling=GREEDY)])
    return [first, second]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def uncached(tiny_qwen2_dir, dtype, every_linear_packed) -> list[list[int]]:
    return [r.token_ids for r in converse(load(tiny_qwen2_dir, caching=False, dtype=dtype), "none")]


@pytest.mark.parametrize("method,tree", [("none", False), ("draft", False), ("ngram", False), ("hybrid", True)])
def test_the_next_turn_reuses_the_answer_and_its_output_is_unchanged(tiny_qwen2_dir, tiny_qwen2_other_dir, dtype,
                                                                     uncached, method, tree):
    target = load(tiny_qwen2_dir, dtype=dtype)
    draft = load(tiny_qwen2_other_dir, dtype=dtype) if method in ("draft", "hybrid") else None
    first, second = converse(target, method, draft, tree)
    assert [first.token_ids, second.token_ids] == uncached
    # The answer's full blocks were cached as it was generated: the second prompt reuses all it can (all but its
    # last token, in whole blocks), far past the first prompt.
    second_len = len(FIRST) + len(first.token_ids) + len(FOLLOW_UP)
    answered = (len(FIRST) + len(first.token_ids) - 1) // BLOCK * BLOCK  # the answer's last token has no KV
    assert second.stats.prompt_tokens_reused == min(answered, (second_len - 1) // BLOCK * BLOCK) > len(FIRST)
    assert target.kv_cache.num_free_blocks == target.kv_cache.num_blocks  # everything released


def test_a_draft_caches_the_verified_text_and_never_its_drafts_or_guesses(tiny_qwen2_dir):
    engine = load(tiny_qwen2_dir)
    draft = DraftEngine(engine)
    assert draft.caches_generated
    tokens = [*FIRST, *range(40, 57)]  # 40: the prompt (23), 13 verified tokens, then 4 guesses of a pipelined round
    verified = len(FIRST) + 13
    (reply,) = ok(draft.run_batch([ProposeCall("a", 0, tokens, 6, GREEDY, prompt_len=len(FIRST),
                                               verified_len=verified)]))
    assert registered(engine) == set(chain_hashes(engine, tokens[:verified]))  # 9 blocks: not the guesses' 10th
    # The target kept one guess and corrected the next: the draft rolls back to it and drafts again.
    kept = [*tokens[:verified + 1], 90]
    ok(draft.run_batch([ProposeCall("a", verified + 1, [90], 6, GREEDY, prompt_len=len(FIRST),
                                    verified_len=len(kept))]))
    assert registered(engine) == set(chain_hashes(engine, kept))  # now 9 full blocks still, 38 tokens: none more
    assert not any(h in registered(engine) for h in chain_hashes(engine, [*tokens, *reply.tokens])[9:])
    with pytest.raises(Exception, match="verified_len 99 outside 0..38"):
        ok(draft.run_batch([ProposeCall("a", len(kept), [], 1, GREEDY, verified_len=99)]))


def test_the_next_turn_s_draft_reads_the_answer_from_its_cache(tiny_qwen2_dir, tiny_qwen2_other_dir):
    target, draft = load(tiny_qwen2_dir), load(tiny_qwen2_other_dir)
    first, second = converse(target, "draft", draft)
    held = len(FIRST) + len(first.token_ids) - 1  # the target's text with KV: the verified tokens
    stats = draft.kv_cache.prefix_stats()
    assert stats.reused_tokens >= held // BLOCK * BLOCK - BLOCK > len(FIRST)  # turn 2's draft read turn 1 back


def test_without_cache_generated_only_prompt_blocks_are_kept(tiny_qwen2_dir):
    engine = load(tiny_qwen2_dir)
    target = TargetEngine(engine, cache_generated=False)
    ok(target.run_batch([PrefillCall("a", FIRST, GREEDY)]))
    for _ in range(4):
        ok(target.run_batch([VerifyCall("a", len(target.sequences["a"].history), [], [])]))
    history = target.sequences["a"].history
    assert len(history) - 1 >= 3 * BLOCK * 2  # several generated blocks' worth of KV
    assert registered(engine) == set(chain_hashes(engine, FIRST))


def test_only_committed_tokens_reach_the_cache_and_each_block_holds_its_prompt_kv(tiny_qwen2_dir):
    engine = load(tiny_qwen2_dir)
    target = TargetEngine(engine)
    ok(target.run_batch([PrefillCall("a", FIRST, GREEDY), PrefillCall("b", FIRST[:13], GREEDY)]))
    for round_ in range(8):  # wrong chains and trees (mostly rejected), and empty ones (a decode step)
        ha, hb = target.sequences["a"].history, target.sequences["b"].history
        drafts = [] if round_ % 3 == 0 else [1, 2, 3]
        ok(target.run_batch([VerifyCall("a", len(ha), drafts, []),
                             VerifyCall("b", len(hb), [4, 5, 6, 7, 8], [], [-1, 0, -1, 2, 2])]))
        # Exactly the full blocks of each sequence's committed tokens with KV (all but the last) are cached.
        expected = {h for seq in ("a", "b")
                    for h in chain_hashes(engine, target.sequences[seq].history[:-1])}
        assert registered(engine) == expected
    # Each cached block holds the KV a fresh prompt of those tokens computes (none of a rejected draft's rows).
    for seq in ("a", "b"):
        history = target.sequences[seq].history
        fresh = load(tiny_qwen2_dir, caching=False)
        TargetEngine(fresh).run_batch([PrefillCall("x", history[:-1] + [0], GREEDY)])
        kv = kv_of(fresh, "x")  # [2, L, len, Hkv, D]
        cache = engine.kv_cache
        for i, content in enumerate(chain_hashes(engine, history[:-1])):
            block = cache.pool.lookup(content)
            cached = torch.stack([cache.key[:, block], cache.value[:, block]])
            assert torch.equal(cached, kv[:, :, i * BLOCK:(i + 1) * BLOCK]), f"{seq}: block {i}"
    ok(target.run_batch([ReleaseCall("a"), ReleaseCall("b")]))


def test_a_retry_that_cuts_back_into_a_cached_generated_block_leaves_the_cache_as_it_was(tiny_qwen2_dir):
    engine = load(tiny_qwen2_dir)
    target = TargetEngine(engine)
    ok(target.run_batch([PrefillCall("a", FIRST, GREEDY)]))
    for _ in range(6):
        ok(target.run_batch([VerifyCall("a", len(target.sequences["a"].history), [], [])]))
    history = list(target.sequences["a"].history)  # 30 tokens: the KV of 29, 7 cached blocks
    cached = registered(engine)
    assert cached == set(chain_hashes(engine, history[:-1]))
    # A Verify from an earlier committed_len (a coordinator's retry) cuts the history back inside block 6, which
    # only this sequence holds: the block leaves the index before it is written, and comes back once committed.
    ok(target.run_batch([VerifyCall("a", 26, [], [])]))
    assert target.sequences["a"].history == history[:27]  # greedy: the same next token
    assert registered(engine) == set(chain_hashes(engine, history[:26]))
    for committed in (27, 28):  # the KV reaches 28 tokens: block 6 is full again, with the same content
        ok(target.run_batch([VerifyCall("a", committed, [], [])]))
    assert registered(engine) == cached


def test_a_rebuild_after_preemption_reads_its_own_generated_blocks_back(tiny_qwen2_dir):
    engine = load(tiny_qwen2_dir)
    target = TargetEngine(engine)
    ok(target.run_batch([PrefillCall("a", FIRST, GREEDY)]))
    for _ in range(14):
        ok(target.run_batch([VerifyCall("a", len(target.sequences["a"].history), [1, 2], [])]))
    history = list(target.sequences["a"].history)
    before = kv_of(engine, "a")
    ok(target.run_batch([ReleaseCall("a")]))  # preempted: its KV freed, its blocks stay cached
    reused = engine.kv_cache.prefix_stats().reused_tokens
    (rebuilt,) = ok(target.run_batch([PrefillCall("a", history, GREEDY, prompt_len=len(FIRST))]))
    # All but its last two tokens' blocks came back (the token before the last is always computed).
    assert engine.kv_cache.prefix_stats().reused_tokens - reused == (len(history) - 2) // BLOCK * BLOCK > len(FIRST)
    assert rebuilt.reused_tokens == len(FIRST)  # the reply counts prompt tokens only (all of them, here)
    assert target.sequences["a"].history == history and torch.equal(kv_of(engine, "a"), before)


def test_no_cache_generated_reaches_every_worker(tiny_qwen2_dir):
    from tandem.cli import build_parser
    from tandem.cli.serve import worker_config
    from tandem.cli.up import cluster_spec

    parser = build_parser()
    spec = cluster_spec(parser.parse_args(["up", "--target", "t", "--draft", "d", "--no-cache-generated"]))
    assert "--no-cache-generated" in spec.worker_args  # targets and drafts
    assert "--no-cache-generated" not in cluster_spec(parser.parse_args(["up", "--target", "t"])).worker_args
    for role in ("target", "draft"):
        serve = ["serve", role, "--model", str(tiny_qwen2_dir)]
        assert worker_config(parser.parse_args(serve)).cache_generated
        assert not worker_config(parser.parse_args([*serve, "--no-cache-generated"])).cache_generated
    assert not DraftEngine(load(tiny_qwen2_dir), cache_generated=False).caches_generated


def test_an_engine_whose_rows_are_not_fixed_by_position_caches_prompt_blocks_only(tiny_qwen2_dir, monkeypatch):
    """Dense weights (a test-sized layer, bf16 on a CPU without native bf16) round a decoded row otherwise than a
    prompt's: a generated block would not hold what a prompt of its tokens computes, so none is offered."""
    from tandem.models import packed
    from tandem.rpc.worker_service import _prefix_cache_info

    monkeypatch.setattr(packed, "MIN_PACKED_ELEMENTS", 1 << 18)  # the tiny model's layers stay dense
    engine = ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype="float32", kv_cache_tokens=4096, block_size=BLOCK))
    target = TargetEngine(engine)  # asked to cache generated blocks (the default), but it cannot
    assert not engine.rows_fixed_by_position and not target.caches_generated
    ok(target.run_batch([PrefillCall("a", FIRST, GREEDY)]))
    for _ in range(12):
        ok(target.run_batch([VerifyCall("a", len(target.sequences["a"].history), [], [])]))
    assert registered(engine) == set(chain_hashes(engine, FIRST))
    assert not _prefix_cache_info(engine.kv_cache.prefix_stats(), target.caches_generated).generated
    monkeypatch.undo()  # the module's packing of every layer is back
    packed_engine = load(tiny_qwen2_dir)
    assert _prefix_cache_info(packed_engine.kv_cache.prefix_stats(), TargetEngine(packed_engine).caches_generated
                              ).generated
