"""Prefix caching and chunked prefill in the engines: output unchanged, cached blocks never touched by speculation.

The rule (docs/DESIGN.md, "Prefix caching"): greedy output with the cache on equals greedy output with it off,
token for token, for every speculation method, in fp32 and in bf16 (a prompt's rows go through the attention
path they take in one run, so they are bitwise the same); chunked prefill the same.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from draft_worker.engine import DraftEngine, ProposeCall
from tandem.block_pool import block_hash
from tandem.compute_thread import CallingThreadExecutor
from tandem.config import EngineConfig
from tandem.cost_fit import ForwardCostFit, PromptTokenCost
from tandem.engine import ModelEngine
from tandem.heads.serving import drafter_for
from tandem.inprocess import GenerationRequest, LocalDraft, SpeculativeGenerator
from tandem.models import packed
from tandem.rpc.batcher import Batcher, Unfinished
from tandem.rpc.prefill_chunks import LONE_CHUNK_S, PrefillChunks
from tandem.sampling import SamplingParams
from tandem.spec.options import SpecOptions
from target_worker.engine import PrefillCall, Prefilled, ReleaseCall, TargetEngine, Verdict, VerifyCall
from tests.heads.tiny_heads import tiny_heads
from tests.target_worker.test_engine import kv_of, ok
from tests.target_worker.test_shared_prompts import dear_prompt_tokens

GREEDY = SamplingParams()
SHARED = list(range(10, 70))  # 60 tokens: prompts below share up to 15 full blocks of 4
PROMPTS = [[*SHARED, 5, 6, 7], [*SHARED, 8], [*SHARED[:40], 9, 9, 9, 9, 9, 9, 9, 9], [61, *SHARED]]


def load(model_dir, caching: bool, dtype: str = "float32") -> ModelEngine:
    return ModelEngine.load(EngineConfig(model_dir, dtype=dtype, kv_cache_tokens=4096, block_size=4,
                                         prefix_caching=caching))


def run(target: ModelEngine, method: str, draft: ModelEngine | None = None, heads=None) -> list:
    options = {"heads_nodes": 6} if heads is not None else {}
    spec = SpecOptions(method, 4 if method != "none" else 0, adaptive_k=False, **options)
    requests = [GenerationRequest(p, max_new_tokens=24, sampling=GREEDY) for p in PROMPTS]
    generator = SpeculativeGenerator(target, draft, spec, heads=heads)  # (warms the engines up, pricing prompts)
    # Whether a prompt waits for the one it shares 60 tokens with (target_worker/shared_prompts.py) weighs their
    # measured price against a step's: on a tiny model, a coin toss of this CPU's timings (CI once saw no wait).
    # Priced dear, every share waits, so the first run reuses the leader's blocks on every machine.
    dear_prompt_tokens(generator.target)
    return generator.generate(requests)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def uncached(tiny_qwen2_dir, dtype) -> list[list[int]]:
    return [r.token_ids for r in run(load(tiny_qwen2_dir, caching=False, dtype=dtype), "none")]


@pytest.mark.parametrize("method", ["none", "draft", "ngram", "hybrid", "medusa", "eagle"])
def test_greedy_output_with_the_prefix_cache_is_the_uncached_output(method, dtype, uncached, tiny_qwen2_dir,
                                                                    tiny_qwen2_other_dir):
    target = load(tiny_qwen2_dir, caching=True, dtype=dtype)
    draft = load(tiny_qwen2_other_dir, caching=True, dtype=dtype) if method in ("draft", "hybrid") else None
    heads = drafter_for(tiny_heads(target, method), target) if method in ("medusa", "eagle") else None
    first = run(target, method, draft, heads)  # fills the cache
    second = run(target, method, draft, heads)  # every prompt's shared blocks are cached now
    assert [r.token_ids for r in first] == uncached
    assert [r.token_ids for r in second] == uncached
    reused = [r.stats.prompt_tokens_reused for r in second]
    # their cached whole blocks (all but the last token at most); EAGLE's from its head's cache as well
    assert reused == [60, 60, 44, 60], reused
    if draft is not None:
        assert draft.kv_cache.prefix_stats().reused_tokens > 0  # the draft's first Propose reused too
    if method == "eagle":
        # the head's cache gave what the target's did, in both runs (the first run's later prompts waited for the
        # first one's blocks, priced dear in run())
        assert heads.cache.prefix_stats().reused_tokens == target.kv_cache.prefix_stats().reused_tokens > sum(reused)
        assert heads.cache.num_free_blocks == heads.cache.num_blocks
    for engine in filter(None, (target, draft)):
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks  # all released, cached ones evictable
        assert all(engine.kv_cache.pool.refcount(b) == 0 for b in range(engine.kv_cache.num_blocks))


def cached_blocks(engine: ModelEngine) -> dict[bytes, torch.Tensor]:
    """Every registered block's K and V, by its content hash."""
    cache = engine.kv_cache
    return {h: torch.stack([cache.key[:, b], cache.value[:, b]]).clone() for b, h in cache.pool._hash_of.items()}


def test_speculative_rounds_never_change_a_cached_block(tiny_qwen2_dir):
    engine = load(tiny_qwen2_dir, caching=True)
    target = TargetEngine(engine)
    prompt = list(range(10, 50))  # 10 full blocks
    ok(target.run_batch([PrefillCall("a", prompt, GREEDY)]))
    before = cached_blocks(engine)
    assert len(before) == 10  # the whole prompt (only prompt blocks are cached)
    (b,) = ok(target.run_batch([PrefillCall("b", [*prompt[:38], 3, 3], GREEDY)]))
    assert b.reused_tokens == 36  # the 38 tokens it shares with a: 9 whole blocks
    for _ in range(3):  # wrong chains and trees: rejected rows written, then rolled back or moved
        ha, hb = target.sequences["a"].history, target.sequences["b"].history
        ok(target.run_batch([VerifyCall("a", len(ha), [1, 2, 3], []),
                             VerifyCall("b", len(hb), [4, 5, 6, 7, 8], [], [-1, 0, -1, 2, 2])]))
    # b rolls back into the middle of a block it shares with a (a start-over of its tail): copy on write.
    ok(target.run_batch([VerifyCall("b", 11, [2, 2, 2], [])]))
    after = cached_blocks(engine)
    assert all(torch.equal(before[h], after[h]) for h in before if h in after)
    assert len(set(before) & set(after)) == 10
    # And a cached block holds what the model computes for its tokens: the blocks of a fresh uncached prefill.
    fresh = load(tiny_qwen2_dir, caching=False)
    TargetEngine(fresh).run_batch([PrefillCall("x", prompt, GREEDY)])
    parent, kv = engine.kv_cache.salt, kv_of(fresh, "x")  # [2, L, len, Hkv, D]
    for i in range(10):
        parent = block_hash(parent, prompt[4 * i:4 * i + 4])
        assert torch.equal(after[parent], kv[:, :, 4 * i:4 * i + 4]), f"block {i}"
    ok(target.run_batch([ReleaseCall("a"), ReleaseCall("b")]))
    assert all(engine.kv_cache.pool.refcount(blk) == 0 for blk in range(engine.kv_cache.num_blocks))


def test_eviction_under_a_small_pool_keeps_output_unchanged(tiny_qwen2_dir, dtype, uncached):
    target = ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype=dtype, kv_cache_tokens=112, block_size=4))
    generator = SpeculativeGenerator(target, None, SpecOptions("ngram", 4))
    for i in (0, 2, 3, 0):  # 28 blocks; a request holds about 23, its prompt's 15 stay cached after it
        (result,) = generator.generate([GenerationRequest(PROMPTS[i], max_new_tokens=24, sampling=GREEDY)])
        assert result.token_ids == uncached[i]
    stats = target.kv_cache.prefix_stats()
    assert stats.evictions > 0 and stats.reused_tokens > 0, stats
    assert target.kv_cache.num_free_blocks == target.kv_cache.num_blocks


def test_a_draft_registers_only_its_prompt(tiny_qwen2_dir):
    draft = DraftEngine(load(tiny_qwen2_dir, caching=True))
    channel = LocalDraft(draft, batcher=None)  # (its hint reads the index alone)
    prompt = list(range(10, 34))  # 6 blocks
    assert channel.cached_prefix(prompt) == 0
    [reply] = ok(draft.run_batch([ProposeCall("a", 0, prompt, 6, GREEDY, prompt_len=len(prompt))]))
    # The KV holds the prompt and 5 drafted tokens (more full blocks' worth): only the prompt is cached.
    assert draft.engine.kv_cache.prefix_stats().cached_blocks == 6
    assert channel.cached_prefix([*prompt, *reply.tokens]) == 24  # what the next request's read is priced by
    ok(draft.run_batch([ProposeCall("b", 0, [*prompt, 7], 2, GREEDY, prompt_len=25)]))
    assert draft.engine.kv_cache.sequence("b").block_ids[:2] == draft.engine.kv_cache.sequence("a").block_ids[:2]


# ----- chunked prefill ---------------------------------------------------------------------------------
LONG = list(range(10, 90))  # 80 tokens
# Steps per chunk size: a chunk ends on an attention piece's boundary (tandem/rpc/prefill_chunks.py).
STEPS = {3: 40, 20: 4}  # 3: cut to 2, so that chunks tile 4-position pieces; 20: a multiple of 4


@pytest.mark.parametrize("chunk", [3, 20])  # a chunk of any size: prompt rows are attended by position
def test_a_long_prompt_is_prefilled_in_chunks_beside_a_running_stream(tiny_qwen2_dir, dtype, chunk, monkeypatch):
    # Packed, as every real model's layers are: oneDNN's kernel over a packed weight is row-invariant, so a chunk's
    # rows are bitwise the whole run's (the tiny model's layers are too small to pack by default, and MKL's fp32
    # kernels change with the row count). bf16 packs only on a CPU that multiplies it; elsewhere its prompt runs
    # take a oneDNN call of their own and short runs ATen's row-invariant dot products.
    monkeypatch.setattr(packed, "MIN_PACKED_ELEMENTS", 0)
    chunked = TargetEngine(load(tiny_qwen2_dir, caching=False, dtype=dtype), prefill_chunk_tokens=chunk)
    whole = TargetEngine(load(tiny_qwen2_dir, caching=False, dtype=dtype))
    (expected,) = ok(whole.run_batch([PrefillCall("b", LONG, GREEDY)]))
    ok(chunked.run_batch([PrefillCall("a", [5, 17, 33], GREEDY)]))  # a stream that is running
    call, steps, result = PrefillCall("b", LONG, GREEDY), 0, Unfinished()
    while isinstance(result, Unfinished):
        n = len(chunked.sequences["a"].history)
        result, verdict = ok(chunked.run_batch([call, VerifyCall("a", n, [], [])]))
        assert isinstance(verdict, Verdict)  # the stream got its token in every step
        steps += 1
    assert steps == STEPS[chunk] and result == expected
    assert torch.equal(kv_of(chunked.engine, "b"), kv_of(whole.engine, "b"))  # every row as in one run
    # Alone on the worker, a prompt that costs less than a lone chunk (LONE_CHUNK_S: this tiny model's) is whole.
    ok(chunked.run_batch([ReleaseCall("a"), ReleaseCall("b")]))
    assert isinstance(ok(chunked.run_batch([PrefillCall("c", LONG, GREEDY)]))[0], Prefilled)


def priced(base_s: float, prompt_token_s: float) -> tuple[ForwardCostFit, PromptTokenCost]:
    """Costs as a large model's passes leave them (the engine's own measurements of this tiny one are not read)."""
    fit, prompt = ForwardCostFit(), PromptTokenCost()
    for tokens in (1, 8, 1, 8):
        fit.observe(tokens, base_s)
    prompt.observe(400, 400 * prompt_token_s)
    return fit, prompt


def test_a_lone_long_prompt_goes_in_chunks_and_a_newcomer_joins_before_it_ends(tiny_qwen2_dir, dtype, monkeypatch):
    monkeypatch.setattr(packed, "MIN_PACKED_ELEMENTS", 0)  # row-invariant kernels, as every real model's (above)
    whole = TargetEngine(load(tiny_qwen2_dir, caching=False, dtype=dtype))
    (expected,) = ok(whole.run_batch([PrefillCall("b", LONG, GREEDY)]))
    chunked = TargetEngine(load(tiny_qwen2_dir, caching=False, dtype=dtype), prefill_chunk_tokens=None)
    # Priced so that a lone chunk is 20 tokens (a second's worth, LONE_CHUNK_S) and one beside a stream 1 token.
    chunked.chunks = PrefillChunks(None, *priced(0.02, LONE_CHUNK_S / 20))
    assert (chunked.chunks.lone_size(), chunked.chunks.size()) == (20, 1)
    long = PrefillCall("b", LONG, GREEDY)
    assert isinstance(ok(chunked.run_batch([long]))[0], Unfinished)  # alone: its first 20 tokens
    assert chunked.engine.seq_len("b") == 20
    # A request arriving now waits one lone chunk, not the whole prompt: it is answered in the next step, where the
    # long prompt takes a small chunk beside it.
    unfinished, first = ok(chunked.run_batch([long, PrefillCall("a", [5, 17, 33], GREEDY)]))
    assert isinstance(unfinished, Unfinished) and isinstance(first, Prefilled)
    assert chunked.engine.seq_len("b") == 21
    steps, result = 0, unfinished
    while isinstance(result, Unfinished):  # the rest goes in chunks beside the newcomer's stream
        result, verdict = ok(chunked.run_batch([long, VerifyCall("a", len(chunked.sequences["a"].history), [], [])]))
        assert isinstance(verdict, Verdict)
        steps += 1
    assert steps == 59 and result == expected  # 1-token chunks, the last one with the first token
    assert torch.equal(kv_of(chunked.engine, "b"), kv_of(whole.engine, "b"))  # every row as in one run


@pytest.mark.parametrize("priorities,order", [((0, 0, 0), ["b", "c", "d"]), ((1, 1, 0), ["d", "b", "c"])])
def test_prompts_arriving_together_at_an_idle_target_share_a_lone_chunk_and_the_oldest_finishes_first(
        tiny_qwen2_dir, monkeypatch, priorities, order):
    """A burst's prompts each took a lone chunk in one step: fifteen 2,000-token prompts of the tiny served model made a
    4.5 s step, and every one of them finished at the burst's end. Of several priorities, the highest goes first."""
    monkeypatch.setattr(packed, "MIN_PACKED_ELEMENTS", 0)  # row-invariant kernels, as every real model's (above)
    prompts = {name: [t + shift for t in LONG] for name, shift in (("b", 0), ("c", 1), ("d", 2))}
    whole = TargetEngine(load(tiny_qwen2_dir, caching=False))
    expected = {name: ok(whole.run_batch([PrefillCall(name, ids, GREEDY)]))[0] for name, ids in prompts.items()}
    chunked = TargetEngine(load(tiny_qwen2_dir, caching=False), prefill_chunk_tokens=None)
    chunked.chunks = PrefillChunks(None, *priced(0.02, LONE_CHUNK_S / 20))  # a lone chunk: 20 tokens, else 1
    calls = [PrefillCall(name, ids, GREEDY, priority=p) for (name, ids), p in zip(prompts.items(), priorities)]
    assert all(isinstance(r, Unfinished) for r in ok(chunked.run_batch(calls)))
    # one lone chunk in the step, not three
    assert [chunked.engine.seq_len(name) for name in order] == [20, 1, 1]
    finished: list[str] = []
    while calls:
        results = ok(chunked.run_batch(calls))
        finished += [call.seq_id for call, r in zip(calls, results) if not isinstance(r, Unfinished)]
        for call, result in zip(calls, results):
            if not isinstance(result, Unfinished):
                assert result == expected[call.seq_id]
        calls = [call for call, r in zip(calls, results) if isinstance(r, Unfinished)]
    assert finished == order  # first come, first served (by priority first)
    for name in prompts:
        assert torch.equal(kv_of(chunked.engine, name), kv_of(whole.engine, name))  # every row as in one run


def test_a_chunked_prompt_released_midway_leaves_no_kv(tiny_qwen2_dir):
    target = TargetEngine(load(tiny_qwen2_dir, caching=False), prefill_chunk_tokens=20)
    ok(target.run_batch([PrefillCall("a", [5, 17, 33], GREEDY)]))
    call = PrefillCall("b", LONG, GREEDY)
    assert isinstance(ok(target.run_batch([call]))[0], Unfinished)
    assert ok(target.run_batch([ReleaseCall("b"), ReleaseCall("a")])) == [True, True]
    assert target.engine.kv_cache.num_free_blocks == target.engine.kv_cache.num_blocks


def test_the_batcher_runs_a_chunked_prompt_over_several_batches_while_a_stream_decodes(tiny_qwen2_dir):
    target = TargetEngine(load(tiny_qwen2_dir, caching=False), prefill_chunk_tokens=20)
    ok(target.run_batch([PrefillCall("a", [5, 17, 33], GREEDY)]))
    batches: list[int] = []

    async def scenario() -> tuple[list[int], Prefilled]:
        batcher = Batcher(target.run_batch, target.call_cost, token_budget=64,  # on the engine's own thread
                          on_batch=lambda calls, tokens, s: batches.append(calls), executor=CallingThreadExecutor())
        batcher.start()
        try:
            long = asyncio.ensure_future(batcher.submit(PrefillCall("b", LONG, GREEDY)))
            tokens = []
            while not long.done():  # a decoding stream: one Verify per step, each answered in its own batch
                verdict = await batcher.submit(VerifyCall("a", len(target.sequences["a"].history), [], []))
                tokens.append(verdict.next_token)
            return tokens, await long
        finally:
            await batcher.stop()

    tokens, prefilled = asyncio.run(scenario())
    assert len(tokens) >= 3  # the stream went on while the prompt was computed
    assert isinstance(prefilled, Prefilled) and max(batches) == 2  # each step: a chunk and the stream's row


def test_a_draft_reads_a_long_prompt_in_chunks_beside_another_sequence(tiny_qwen2_dir, dtype):
    chunked = DraftEngine(load(tiny_qwen2_dir, caching=False, dtype=dtype), prefill_chunk_tokens=20)
    whole = DraftEngine(load(tiny_qwen2_dir, caching=False, dtype=dtype))
    (expected,) = ok(whole.run_batch([ProposeCall("b", 0, LONG, 3, GREEDY, prompt_len=len(LONG))]))
    ok(chunked.run_batch([ProposeCall("a", 0, [5, 17, 33], 2, GREEDY, prompt_len=3)]))  # another stream, held here
    call, steps, result = ProposeCall("b", 0, LONG, 3, GREEDY, prompt_len=len(LONG)), 0, Unfinished()
    while isinstance(result, Unfinished):
        (result,) = ok(chunked.run_batch([call]))
        steps += 1
    assert steps == 4  # three chunks of 20, then the last 20 tokens and the drafting
    assert result.tokens == expected.tokens


def test_a_draft_reads_a_lone_long_prompt_in_chunks(tiny_qwen2_dir):
    whole = DraftEngine(load(tiny_qwen2_dir, caching=False))
    (expected,) = ok(whole.run_batch([ProposeCall("b", 0, LONG, 3, GREEDY, prompt_len=len(LONG))]))
    chunked = DraftEngine(load(tiny_qwen2_dir, caching=False), prefill_chunk_tokens=None)
    chunked.chunks = PrefillChunks(None, *priced(0.02, LONE_CHUNK_S / 20))  # lone chunks of 20 (test above)
    call, steps, result = ProposeCall("b", 0, LONG, 3, GREEDY, prompt_len=len(LONG)), 0, Unfinished()
    while isinstance(result, Unfinished):
        (result,) = ok(chunked.run_batch([call]))
        steps += 1
    assert steps == 4 and result.tokens == expected.tokens  # three chunks of 20, then the rest and the drafting
    # A newcomer's short prompt beside a lone one is read whole in its first step, the long one a chunk beside it.
    long = ProposeCall("c", 0, LONG, 3, GREEDY, prompt_len=len(LONG))
    released, unfinished = ok(chunked.run_batch([ReleaseCall("b"), long]))  # alone again: a lone chunk
    assert released is True and isinstance(unfinished, Unfinished) and chunked.engine.seq_len("c") == 20
    unfinished, proposed = ok(chunked.run_batch([long, ProposeCall("d", 0, [5, 17, 33], 2, GREEDY, prompt_len=3)]))
    assert isinstance(unfinished, Unfinished) and len(proposed.tokens) == 2
    # Long prompts arriving together share one lone chunk: the oldest takes it, the others a small one beside it.
    ok(chunked.run_batch([ReleaseCall("c"), ReleaseCall("d")]))
    burst = [ProposeCall(name, 0, [t + shift for t in LONG], 3, GREEDY, prompt_len=len(LONG))
             for name, shift in (("e", 0), ("f", 1), ("g", 2))]
    assert all(isinstance(r, Unfinished) for r in ok(chunked.run_batch(burst)))
    assert [chunked.engine.seq_len(name) for name in "efg"] == [20, 1, 1]


def test_the_engine_says_how_many_rows_its_running_forward_computes(tiny_qwen2_dir):
    """What a worker's Info prices its running step by (``step_tokens``), for a coordinator asking whether it is hung:
    a lone prompt chunk is far more rows than its call's cost (a running-size chunk)."""
    target = TargetEngine(load(tiny_qwen2_dir, caching=False), prefill_chunk_tokens=None)
    target.chunks = PrefillChunks(None, *priced(0.02, LONE_CHUNK_S / 20))  # a lone chunk: 20 tokens, else 1
    seen: list[int] = []
    run = target.engine._run

    def recording(*args, **kwargs):
        seen.append(target.engine.rows_in_forward)
        return run(*args, **kwargs)

    target.engine._run = recording
    assert target.engine.rows_in_forward == 0
    call = PrefillCall("b", LONG, GREEDY)
    assert target.call_cost(call) == 1 and isinstance(ok(target.run_batch([call]))[0], Unfinished)
    assert seen == [20] and target.engine.rows_in_forward == 0  # the lone chunk's 20 rows while it ran, then none
