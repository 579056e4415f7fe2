"""Greedy speculative output is the target's own output, token for token, for every proposer."""

from __future__ import annotations

import pytest

from draft_worker.engine import early_exit_engine
from tandem.config import EngineConfig
from tandem.engine import ModelEngine
from tandem.inprocess import GenerationRequest, SpeculativeGenerator
from tandem.sampling import SamplingParams
from tandem.spec.options import SpecOptions

PROMPTS = [[5, 17, 33], [9, 9, 9, 9, 9, 9, 9, 9], list(range(10, 40)), [61]]
DEFAULT_SAMPLING = SamplingParams()


def load(model_dir, tokens: int = 8192, **draft_options) -> ModelEngine:
    return ModelEngine.load(EngineConfig(model_dir, dtype="float32", kv_cache_tokens=tokens, block_size=4,
                                         **draft_options))


def run(target: ModelEngine, draft: ModelEngine | None = None, method: str = "none", prompts=PROMPTS, n: int = 40,
        stop=frozenset(), sampling=DEFAULT_SAMPLING, k_max: int = 0, adaptive_k: bool = False, **options) -> list:
    """Every prompt through the in-process generator (the one loop), together: their calls share batches."""
    spec = SpecOptions(method, k_max, adaptive_k, **options)
    requests = [GenerationRequest(p, max_new_tokens=n, sampling=sampling, stop_token_ids=stop) for p in prompts]
    return SpeculativeGenerator(target, draft, spec).generate(requests)


@pytest.fixture(scope="module")
def target(tiny_qwen2_dir):
    return load(tiny_qwen2_dir)


@pytest.fixture(scope="module")
def plain(target):
    return [r.token_ids for r in run(target, None)]


def test_draft_equal_to_target_accepts_everything(target, plain, tiny_qwen2_dir):
    results = run(target, load(tiny_qwen2_dir), "draft", k_max=4)
    assert [r.token_ids for r in results] == plain
    assert all(r.stats.drafted > 0 and r.stats.accepted == r.stats.drafted for r in results)
    assert target.kv_cache.num_free_blocks == target.kv_cache.num_blocks  # every sequence released


def test_adaptive_k_output_unchanged(target, plain, tiny_qwen2_dir):
    # Adaptive k may decline to draft here (a draft as big as the target never pays): output is the same.
    results = run(target, load(tiny_qwen2_dir), "draft", k_max=4, adaptive_k=True)
    assert [r.token_ids for r in results] == plain


def test_unrelated_draft_is_mostly_rejected_but_output_unchanged(target, plain, tiny_qwen2_other_dir):
    results = run(target, load(tiny_qwen2_other_dir), "draft", k_max=3)
    assert [r.token_ids for r in results] == plain
    drafted = sum(r.stats.drafted for r in results)
    assert sum(r.stats.accepted for r in results) < 0.3 * drafted


def test_lean_draft_output_unchanged(target, plain, tiny_qwen2_dir):
    """An int8 draft scoring a third of the vocabulary disagrees with the target now and then; output does not."""
    lean = load(tiny_qwen2_dir, quantization="int8", vocab_limit=32)
    results = run(target, lean, "draft", k_max=4)
    assert [r.token_ids for r in results] == plain
    accepted, drafted = sum(r.stats.accepted for r in results), sum(r.stats.drafted for r in results)
    assert 0 < accepted < drafted  # some proposals right, some (ids >= 32 at least) wrong


def test_ngram_lookup_output_unchanged(target, plain):
    results = run(target, None, "ngram", k_max=5, ngram_max=3)
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.drafted for r in results) > 0


def test_hybrid_output_unchanged_and_uses_both_sources(target, plain, tiny_qwen2_other_dir):
    results = run(target, load(tiny_qwen2_other_dir), "hybrid", k_max=4, ngram_max=3, hybrid_min_match=2)
    assert [r.token_ids for r in results] == plain
    ngram = sum(r.stats.ngram_rounds for r in results)
    assert 0 < ngram < sum(r.stats.spec_rounds for r in results)  # n-gram matched some rounds, the draft the rest


@pytest.mark.parametrize("method", ["draft", "hybrid", "ngram"])
def test_token_trees_output_unchanged_and_branches_are_kept(target, plain, tiny_qwen2_other_dir, method):
    """An unrelated draft is mostly wrong: its next-best tokens and the n-gram branches save some rounds."""
    draft = None if method == "ngram" else load(tiny_qwen2_other_dir)
    results = run(target, draft, method, k_max=3, ngram_max=3, hybrid_min_match=2, tree="on", tree_width=2)
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.tree_rounds for r in results) > 0
    assert sum(r.stats.branch_tokens for r in results) > 0
    assert target.kv_cache.num_free_blocks == target.kv_cache.num_blocks


def test_early_exit_output_unchanged(target, plain):
    results = run(target, early_exit_engine(target, 1), "early-exit", k_max=3)
    assert [r.token_ids for r in results] == plain


def test_stop_token_inside_an_accepted_run_ends_the_output_there(target, tiny_qwen2_dir):
    prompt = PROMPTS[2]
    full = run(target, prompts=[prompt])[0].token_ids
    # The first token whose first occurrence is past position 4: stopping there cuts a run of accepted drafts.
    stop_index = next(i for i, t in enumerate(full) if i > 4 and t not in full[:i])
    stop = frozenset({full[stop_index]})
    result = run(target, load(tiny_qwen2_dir), "draft", [prompt], stop=stop, k_max=4)[0]
    assert result.token_ids == full[: stop_index + 1]
    assert result.finish_reason == "stop"


@pytest.mark.parametrize("n", [1, 2, 7, 13])
def test_max_new_tokens_is_exact_inside_accepted_runs(target, tiny_qwen2_dir, n):
    result = run(target, load(tiny_qwen2_dir), "draft", [PROMPTS[0]], n=n, k_max=4)[0]
    assert len(result.token_ids) == n and result.finish_reason == "length"


def test_seeded_sampling_repeats(target, tiny_qwen2_other_dir):
    draft = load(tiny_qwen2_other_dir)
    sampling = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=1234)
    first = run(target, draft, "draft", sampling=sampling, k_max=3)
    second = run(target, draft, "draft", sampling=sampling, k_max=3)
    assert [r.token_ids for r in first] == [r.token_ids for r in second]


@pytest.mark.slow
def test_smollm2_early_exit_greedy_identical(smollm2_dir):
    from tandem.tokenizer import encode_prompt, load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    prompts = [encode_prompt(tok, p, chat=True) for p in
               ("List three prime numbers.", "def add(a, b):\n    return a + b\n\nExplain this code.")]
    target = load(smollm2_dir)
    plain = [r.token_ids for r in run(target, prompts=prompts, n=48)]
    results = run(target, early_exit_engine(target, 20), "early-exit", prompts, n=48, k_max=3)
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.accepted for r in results) > 0


BF16_PROMPTS = ("Write a story about a cat.", "Repeat after me: alpha beta gamma alpha beta gamma.")
# 40 new tokens each (was 60): emulated bf16 on a CPU without it costs about 2.5x fp32, and these four ran about
# 150 s of CI's 2-core time; 40 still gives every method's chains, trees and rejections several rounds.
BF16_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_dir):
    """SmolLM2's bf16 target, a bf16 copy of it as its own draft, the prompts and the target-only output:
    loaded and computed once for every method below (each run releases its sequences)."""
    from tandem.tokenizer import encode_prompt, load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    prompts = [encode_prompt(tok, p, chat=True) for p in BF16_PROMPTS]
    target = ModelEngine.load(EngineConfig(smollm2_dir, dtype="bfloat16", kv_cache_tokens=8192))
    draft = ModelEngine.load(EngineConfig(smollm2_dir, dtype="bfloat16"))
    plain = [r.token_ids for r in run(target, prompts=prompts, n=BF16_NEW_TOKENS)]
    return target, draft, prompts, plain


@pytest.mark.slow
@pytest.mark.parametrize("method,tree", [("ngram", "off"), ("draft", "off"), ("ngram", "on"), ("hybrid", "on")])
def test_smollm2_bf16_speculative_greedy_identical(smollm2_bf16, method, tree):
    """In bf16 too: verification rows are computed exactly like decode steps (batch-invariant kernels).

    Chains from an n-gram lookup (few accepted) and from a draft model (all accepted), trees from both. Not
    early exit: on SmolLM2 it accepts about one draft token in twenty, so its chain and tree took 64 of the
    114 s that six methods took here (emulated bf16, AMD Zen 3), and they give the target's kernels no shape
    that the others do not; its own greedy identity is checked in fp32 above."""
    target, same_model, prompts, plain = smollm2_bf16
    draft = None if method == "ngram" else same_model  # the same model drafting for itself
    results = run(target, draft, method, prompts, n=BF16_NEW_TOKENS, k_max=4, ngram_max=3, tree=tree)
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.drafted for r in results) > 0
    if tree == "on":  # trees, each path scored in bf16 bit for bit as a chain of it would be
        assert sum(r.stats.tree_rounds for r in results) > 0
    if method == "draft":  # the same model drafting: every draft token is accepted, in bf16 too
        assert all(r.stats.accepted == r.stats.drafted for r in results)
    for engine in (target, same_model):  # every sequence released: the next method starts clean
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
