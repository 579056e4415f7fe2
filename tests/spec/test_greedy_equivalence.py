"""Greedy speculative output is the target's own output, token for token, for every proposer."""

from __future__ import annotations

import pytest

from tandem.config import EngineConfig
from tandem.engine import ModelEngine
from tandem.sampling import SamplingParams
from tandem.spec.draft_model import DraftModelProposer, early_exit_proposer
from tandem.spec.generator import GenerationRequest, SpeculativeGenerator
from tandem.spec.ngram import NgramProposer

PROMPTS = [[5, 17, 33], [9, 9, 9, 9, 9, 9, 9, 9], list(range(10, 40)), [61]]


def load(model_dir, tokens: int = 8192, **draft_options) -> ModelEngine:
    return ModelEngine.load(EngineConfig(model_dir, dtype="float32", kv_cache_tokens=tokens, block_size=4,
                                         **draft_options))


def run(target: ModelEngine, proposer, prompts=PROMPTS, n: int = 40, stop=frozenset(), **kw) -> list:
    requests = [GenerationRequest(p, max_new_tokens=n, stop_token_ids=stop, **kw) for p in prompts]
    return SpeculativeGenerator(target, proposer).generate(requests)


@pytest.fixture(scope="module")
def target(tiny_qwen2_dir):
    return load(tiny_qwen2_dir)


@pytest.fixture(scope="module")
def plain(target):
    return [r.token_ids for r in run(target, None)]


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
def test_draft_equal_to_target_accepts_everything(target, plain, tiny_qwen2_dir, adaptive):
    results = run(target, DraftModelProposer(load(tiny_qwen2_dir)), k_max=4, adaptive_k=adaptive)
    assert [r.token_ids for r in results] == plain
    assert all(r.stats.accepted == r.stats.drafted for r in results)
    # Fixed k always drafts; adaptive k may decline here, since a draft as big as the target never pays.
    assert adaptive or all(r.stats.drafted > 0 for r in results)
    assert target.kv_cache.num_free_blocks == target.kv_cache.num_blocks


def test_unrelated_draft_is_mostly_rejected_but_output_unchanged(target, plain, tiny_qwen2_other_dir):
    results = run(target, DraftModelProposer(load(tiny_qwen2_other_dir)), k_max=3, adaptive_k=False)
    assert [r.token_ids for r in results] == plain
    drafted = sum(r.stats.drafted for r in results)
    assert sum(r.stats.accepted for r in results) < 0.3 * drafted


def test_lean_draft_output_unchanged(target, plain, tiny_qwen2_dir):
    """An int8 draft scoring a third of the vocabulary disagrees with the target now and then; output does not."""
    lean = load(tiny_qwen2_dir, quantization="int8", vocab_limit=32)
    results = run(target, DraftModelProposer(lean), k_max=4, adaptive_k=False)
    assert [r.token_ids for r in results] == plain
    accepted, drafted = sum(r.stats.accepted for r in results), sum(r.stats.drafted for r in results)
    assert 0 < accepted < drafted  # some proposals right, some (ids >= 32 at least) wrong


def test_ngram_lookup_output_unchanged(target, plain):
    results = run(target, NgramProposer(1, 3), k_max=5, adaptive_k=False)
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.drafted for r in results) > 0


def test_hybrid_output_unchanged_and_uses_both_sources(target, plain, tiny_qwen2_other_dir):
    from tandem.spec.hybrid import HybridProposer

    draft = DraftModelProposer(load(tiny_qwen2_other_dir))
    calls = []
    original = draft.propose
    draft.propose = lambda reqs: calls.append(len(reqs)) or original(reqs)
    results = run(target, HybridProposer(draft, min_match=2, max_n=3), k_max=4, adaptive_k=False)
    assert [r.token_ids for r in results] == plain
    assert sum(calls) > 0  # the draft model drafted some rounds...
    assert sum(calls) < sum(r.stats.spec_rounds for r in results)  # ...and n-gram matches others


def test_early_exit_output_unchanged(target, plain):
    results = run(target, early_exit_proposer(target, 1), k_max=3, adaptive_k=False)
    assert [r.token_ids for r in results] == plain


def test_stop_token_inside_an_accepted_run_ends_the_output_there(target, tiny_qwen2_dir):
    prompt = PROMPTS[2]
    full = run(target, None, [prompt])[0].token_ids
    # The first token whose first occurrence is past position 4: stopping there cuts a run of accepted drafts.
    stop_index = next(i for i, t in enumerate(full) if i > 4 and t not in full[:i])
    stop = frozenset({full[stop_index]})
    result = run(target, DraftModelProposer(load(tiny_qwen2_dir)), [prompt], stop=stop, k_max=4, adaptive_k=False)[0]
    assert result.token_ids == full[: stop_index + 1]
    assert result.finish_reason == "stop"


@pytest.mark.parametrize("n", [1, 2, 7, 13])
def test_max_new_tokens_is_exact_inside_accepted_runs(target, tiny_qwen2_dir, n):
    result = run(target, DraftModelProposer(load(tiny_qwen2_dir)), [PROMPTS[0]], n=n, k_max=4, adaptive_k=False)[0]
    assert len(result.token_ids) == n and result.finish_reason == "length"


def test_seeded_sampling_repeats(target, tiny_qwen2_other_dir):
    draft = DraftModelProposer(load(tiny_qwen2_other_dir))
    sampling = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=1234)
    first = run(target, draft, sampling=sampling, k_max=3, adaptive_k=False)
    second = run(target, draft, sampling=sampling, k_max=3, adaptive_k=False)
    assert [r.token_ids for r in first] == [r.token_ids for r in second]


@pytest.mark.slow
def test_smollm2_early_exit_greedy_identical(smollm2_dir):
    from tandem.tokenizer import encode_prompt, load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    prompts = [encode_prompt(tok, p, chat=True) for p in
               ("List three prime numbers.", "def add(a, b):\n    return a + b\n\nExplain this code.")]
    target = load(smollm2_dir)
    plain = [r.token_ids for r in run(target, None, prompts, n=48)]
    results = run(target, early_exit_proposer(target, 20), prompts, n=48, k_max=3, adaptive_k=False)
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.accepted for r in results) > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["early-exit", "ngram", "self-draft"])
def test_smollm2_bf16_speculative_greedy_identical(smollm2_dir, method):
    """In bf16 too: verification rows are computed exactly like decode steps (batch-invariant kernels)."""
    from tandem.tokenizer import encode_prompt, load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    prompts = [encode_prompt(tok, p, chat=True) for p in
               ("Write a story about a cat.", "Repeat after me: alpha beta gamma alpha beta gamma.")]
    target = ModelEngine.load(EngineConfig(smollm2_dir, dtype="bfloat16", kv_cache_tokens=8192))
    proposer = {
        "early-exit": lambda: early_exit_proposer(target, 20),
        "ngram": lambda: NgramProposer(1, 3),
        "self-draft": lambda: DraftModelProposer(ModelEngine.load(EngineConfig(smollm2_dir, dtype="bfloat16"))),
    }[method]()
    plain = [r.token_ids for r in run(target, None, prompts, n=60)]
    results = run(target, proposer, prompts, n=60, k_max=4, adaptive_k=False)
    assert [r.token_ids for r in results] == plain
    if method == "self-draft":  # the same model drafting: every draft token is accepted, in bf16 too
        assert all(r.stats.accepted == r.stats.drafted for r in results)
