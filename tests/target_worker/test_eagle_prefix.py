"""EAGLE's head caches its KV beside the target's: an EAGLE prompt starts on the prefix cache too.

A head row at position t is made of the target's feature at t and the token at t + 1, so the head's blocks are keyed
by chains of (token, next token) pairs, and a prompt starts on the blocks both caches hold. The rules are the
target's (docs/DESIGN.md, "Prefix caching"): only committed rows are offered, so a drafted tree's or a rejected
draft's row never reaches a cached block; every cached block holds what a prompt of its tokens computes; output and
proposals with the cache on equal them with it off.
"""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine import ModelEngine
from tandem.heads.drafters import EagleDrafter, NextTokenPairs
from tandem.heads.serving import drafter_for
from tandem.inprocess import GenerationRequest, SpeculativeGenerator
from tandem.sampling import SamplingParams
from tandem.spec.options import SpecOptions
from target_worker.engine import PrefillCall, Proposed, ReleaseCall, TargetEngine, VerifyCall
from tests.heads.tiny_heads import tiny_heads
from tests.target_worker.test_engine import ok
from tests.target_worker.test_generated_prefix import BLOCK, hash_chain

# Packed layers (the target's and so the head's): rows fixed by position, as a real model's are on this CPU.
pytestmark = pytest.mark.usefixtures("every_linear_packed")

GREEDY = SamplingParams()
FIRST = list(range(10, 33))  # 23 tokens: the first turn's prompt ends inside a block
FOLLOW_UP = [5, 6, 7, 8, 9, 5]
NODES = 6


def load(model_dir, caching: bool = True, dtype: str = "float32") -> tuple[ModelEngine, EagleDrafter]:
    config = EngineConfig(model_dir, dtype=dtype, kv_cache_tokens=4096, block_size=BLOCK, prefix_caching=caching)
    if not config.pack_weights:
        pytest.skip(f"{dtype} weights are not packed on this CPU: its rows are not fixed by position")
    engine = ModelEngine.load(config)
    return engine, drafter_for(tiny_heads(engine, "eagle"), engine)


def pair_hashes(drafter: EagleDrafter, tokens: list[int]) -> list[bytes]:
    """The head's content hashes of the full blocks of rows whose pairs ``tokens`` holds, in order."""
    return hash_chain(drafter.cache.salt, NextTokenPairs(tokens))


def registered(drafter: EagleDrafter) -> set[bytes]:
    return set(drafter.cache.pool._hash_of.values())


def head_kv(drafter: EagleDrafter, seq_id: str) -> torch.Tensor:
    """``[2, length, Hkv, D]``: the head's K and V of a sequence."""
    cache = drafter.cache
    seq = cache.sequence(seq_id)
    positions = torch.arange(seq.length)
    blocks = torch.tensor(seq.block_ids, dtype=torch.int64)[positions // BLOCK]
    return torch.stack([cache.key[0, blocks, positions % BLOCK], cache.value[0, blocks, positions % BLOCK]])


def converse(engine: ModelEngine, drafter: EagleDrafter | None, method: str = "eagle") -> list:
    """Two turns: the second prompt is the first, its answer and a follow-up."""
    spec = SpecOptions(method, 4 if method != "none" else 0, adaptive_k=False,
                       **({"heads_nodes": NODES} if drafter is not None else {}))
    generator = SpeculativeGenerator(engine, None, spec, heads=drafter)
    (first,) = generator.generate([GenerationRequest(FIRST, max_new_tokens=30, sampling=GREEDY)])
    (second,) = generator.generate([GenerationRequest([*FIRST, *first.token_ids, *FOLLOW_UP], max_new_tokens=20,
                                                      sampling=GREEDY)])
    return [first, second]


def test_next_token_pairs_are_each_token_and_the_one_after():
    tokens = [7, 3, 2**31 - 1, 0, 5]
    pairs = NextTokenPairs(tokens)
    expected = [7 << 32 | 3, 3 << 32 | (2**31 - 1), (2**31 - 1) << 32, 5]
    assert len(pairs) == 4 and list(pairs) == expected
    assert pairs[1:3] == expected[1:3] and pairs[2:99] == expected[2:] and pairs[-1] == 5
    assert len(NextTokenPairs([4])) == 0 and NextTokenPairs([]).__getitem__(slice(0, 4)) == []
    with pytest.raises(IndexError):
        pairs[4]
    # Pairs that differ only in the token after: two different rows (the token order counts, too).
    assert NextTokenPairs([1, 2])[0] != NextTokenPairs([1, 3])[0] != NextTokenPairs([3, 1])[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_next_turn_reuses_the_answer_with_eagle_and_nothing_else_changes(tiny_qwen2_dir, dtype):
    uncached_engine, uncached_drafter = load(tiny_qwen2_dir, caching=False, dtype=dtype)
    target_only = converse(uncached_engine, None, "none")
    uncached = converse(uncached_engine, uncached_drafter)
    engine, drafter = load(tiny_qwen2_dir, dtype=dtype)
    first, second = converse(engine, drafter)
    assert [first.token_ids, second.token_ids] == [r.token_ids for r in target_only] == \
        [r.token_ids for r in uncached]
    # The same proposals every round: the head's rows read from its cache are the rows it would have computed.
    for cached, fresh in zip((first, second), uncached):
        assert (cached.stats.rounds, cached.stats.drafted, cached.stats.accepted, cached.stats.depth_kept) == \
            (fresh.stats.rounds, fresh.stats.drafted, fresh.stats.accepted, fresh.stats.depth_kept)
    assert first.stats.spec_rounds > 0  # the head proposed
    # Turn 2 took all it could from both caches: its prompt and turn 1's answer, past turn 1's prompt.
    second_len = len(FIRST) + len(first.token_ids) + len(FOLLOW_UP)
    answered = (len(FIRST) + len(first.token_ids) - 1) // BLOCK * BLOCK  # the answer's last token has no KV
    assert second.stats.prompt_tokens_reused == min(answered, (second_len - 1) // BLOCK * BLOCK) > len(FIRST)
    stats = drafter.cache.prefix_stats()  # every prompt counted, the first turn's miss too (a row per pair)
    assert (stats.prompt_tokens, stats.reused_tokens) == (len(FIRST) - 1 + second_len - 1,
                                                          second.stats.prompt_tokens_reused)
    for cache in (engine.kv_cache, drafter.cache):  # all released; cached blocks are evictable
        assert cache.num_free_blocks == cache.num_blocks


def test_only_committed_rows_reach_the_head_s_cache_and_each_block_holds_its_prompt_rows(tiny_qwen2_dir):
    engine, drafter = load(tiny_qwen2_dir)
    target = TargetEngine(engine, drafter=drafter)
    a, b = ok(target.run_batch([PrefillCall("a", FIRST, GREEDY, propose=NODES),
                                PrefillCall("b", FIRST[:13], GREEDY, propose=NODES)]))
    proposal = {"a": a.proposal, "b": b.proposal}
    for round_ in range(8):  # the head's own trees, wrong chains (mostly rejected) and empty ones (a decode step)
        calls = []
        for seq in ("a", "b"):
            history = target.sequences[seq].history
            if round_ % 3 == 1 and seq == "a":
                calls.append(VerifyCall(seq, len(history), [1, 2, 3], [], propose=NODES))
            elif round_ % 3 == 2:
                calls.append(VerifyCall(seq, len(history), [], [], propose=NODES))
            else:
                calls.append(VerifyCall(seq, len(history), proposal[seq].tokens, [], proposal[seq].parents,
                                        propose=NODES))
        for call, result in zip(calls, ok(target.run_batch(calls))):
            assert isinstance(result, Proposed)
            proposal[call.seq_id] = result.proposal
        # Exactly the full blocks of each sequence's rows with KV (all but the last token's) are cached.
        expected = {h for seq in ("a", "b") for h in pair_hashes(drafter, target.sequences[seq].history)}
        assert registered(drafter) == expected
        assert all(drafter.length(s) == engine.seq_len(s) for s in ("a", "b"))
    # Each cached block holds the head's rows a fresh prompt of those tokens computes.
    for seq in ("a", "b"):
        history = target.sequences[seq].history
        fresh_engine, fresh = load(tiny_qwen2_dir, caching=False)
        ok(TargetEngine(fresh_engine, drafter=fresh).run_batch([PrefillCall("x", history, GREEDY, propose=1)]))
        kv = head_kv(fresh, "x")  # [2, len(history), Hkv, D]
        for i, content in enumerate(pair_hashes(drafter, history)):
            block = drafter.cache.pool.lookup(content)
            cached = torch.stack([drafter.cache.key[0, block], drafter.cache.value[0, block]])
            assert torch.equal(cached, kv[:, i * BLOCK:(i + 1) * BLOCK]), f"{seq}: block {i}"
    ok(target.run_batch([ReleaseCall("a"), ReleaseCall("b")]))
    assert drafter.cache.num_free_blocks == drafter.cache.num_blocks


def test_a_prompt_starts_where_the_head_s_cache_ends_when_it_holds_less_than_the_target_s(tiny_qwen2_dir):
    engine, drafter = load(tiny_qwen2_dir)
    target_only = converse(load(tiny_qwen2_dir, caching=False)[0], None, "none")
    generator = SpeculativeGenerator(engine, None, SpecOptions("eagle", 4, adaptive_k=False, heads_nodes=NODES),
                                     heads=drafter)
    (first,) = generator.generate([GenerationRequest(FIRST, max_new_tokens=30, sampling=GREEDY)])
    prompt = [*FIRST, *first.token_ids, *FOLLOW_UP]
    # Other sequences fill the head's pool and evict all but its first 3 cached blocks (a chain's tail goes first).
    cache = drafter.cache
    cache.append_slots({"other": (cache.pool.num_free + len(registered(drafter)) - 3) * BLOCK})
    cache.release("other")
    assert engine.kv_cache.cached_prefix_len(prompt) > 3 * BLOCK == drafter.cached_prefix_len(prompt)
    (second,) = generator.generate([GenerationRequest(prompt, max_new_tokens=20, sampling=GREEDY)])
    assert second.stats.prompt_tokens_reused == 3 * BLOCK  # the target computed the rows the head lacked
    assert [first.token_ids, second.token_ids] == [r.token_ids for r in target_only]


def test_a_retry_that_cuts_back_into_a_cached_head_block_leaves_the_head_s_cache_as_it_was(tiny_qwen2_dir):
    engine, drafter = load(tiny_qwen2_dir)
    target = TargetEngine(engine, drafter=drafter)
    ok(target.run_batch([PrefillCall("a", FIRST, GREEDY, propose=NODES)]))
    for _ in range(6):
        ok(target.run_batch([VerifyCall("a", len(target.sequences["a"].history), [], [], propose=NODES)]))
    history = list(target.sequences["a"].history)  # 30 tokens: 29 rows, 7 cached blocks
    cached = registered(drafter)
    assert cached == set(pair_hashes(drafter, history))
    # A retry from committed_len 26 cuts the rows back inside block 6, which only this sequence holds: it leaves the
    # index before the head writes it, and comes back once its rows are committed again, the same.
    ok(target.run_batch([VerifyCall("a", 26, [], [], propose=NODES)]))
    assert registered(drafter) == set(pair_hashes(drafter, history[:27]))
    for committed in (27, 28):  # 28 rows: block 6 is full again, with the same content (greedy: the same tokens)
        ok(target.run_batch([VerifyCall("a", committed, [], [], propose=NODES)]))
    assert target.sequences["a"].history == history[:29]
    assert registered(drafter) == cached


def test_without_prefix_caching_the_head_caches_nothing(tiny_qwen2_dir):
    engine, drafter = load(tiny_qwen2_dir, caching=False)
    assert not drafter.cache.prefix_caching
    first, second = converse(engine, drafter)
    assert second.stats.prompt_tokens_reused == 0 and not registered(drafter)


@pytest.mark.parametrize("chunk", [3, 20])
def test_an_eagle_prompt_is_prefilled_in_chunks_beside_a_running_stream(tiny_qwen2_dir, chunk):
    """Each chunk's rows go to the head as they are computed: its KV and its first proposal are the whole run's."""
    engine, drafter = load(tiny_qwen2_dir, caching=False)
    chunked = TargetEngine(engine, drafter=drafter, prefill_chunk_tokens=chunk)
    whole_engine, whole_drafter = load(tiny_qwen2_dir, caching=False)
    long = list(range(10, 90))  # 80 tokens
    (expected,) = ok(TargetEngine(whole_engine, drafter=whole_drafter).run_batch(
        [PrefillCall("b", long, GREEDY, propose=NODES)]))
    ok(chunked.run_batch([PrefillCall("a", [5, 17, 33], GREEDY, propose=NODES)]))  # a stream that is running
    call, steps, result = PrefillCall("b", long, GREEDY, propose=NODES), 0, None
    while not isinstance(result, Proposed):
        n = len(chunked.sequences["a"].history)
        result, verdict = ok(chunked.run_batch([call, VerifyCall("a", n, [], [], propose=NODES)]))
        assert isinstance(verdict, Proposed)  # the stream got its token and its proposal in every step
        steps += 1
        assert drafter.length("b") == engine.seq_len("b")  # the head keeps up with every chunk
    assert steps > 1 and result.result == expected.result and result.proposal == expected.proposal
    assert torch.equal(head_kv(drafter, "b"), head_kv(whole_drafter, "b"))


def test_a_rebuild_after_preemption_reads_the_head_s_rows_back_too(tiny_qwen2_dir):
    engine, drafter = load(tiny_qwen2_dir)
    target = TargetEngine(engine, drafter=drafter)
    (result,) = ok(target.run_batch([PrefillCall("a", FIRST, GREEDY, propose=NODES)]))
    for _ in range(10):
        proposal = result.proposal
        (result,) = ok(target.run_batch([VerifyCall("a", len(target.sequences["a"].history), proposal.tokens, [],
                                                    proposal.parents, propose=NODES)]))
    history = list(target.sequences["a"].history)
    before = head_kv(drafter, "a")
    ok(target.run_batch([ReleaseCall("a")]))  # preempted: its KV and its head's freed, their blocks stay cached
    reused = drafter.cache.prefix_stats().reused_tokens
    (rebuilt,) = ok(target.run_batch([PrefillCall("a", history, GREEDY, prompt_len=len(FIRST), propose=NODES)]))
    # Both caches gave back all but the last two tokens' blocks (the token before the last is always computed).
    assert drafter.cache.prefix_stats().reused_tokens - reused == (len(history) - 2) // BLOCK * BLOCK > len(FIRST)
    assert isinstance(rebuilt, Proposed) and rebuilt.proposal == result.proposal  # as if never preempted
    assert torch.equal(head_kv(drafter, "a"), before)
