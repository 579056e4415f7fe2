"""The rejection sampler: defined cases, determinism, and a statistical test of losslessness.

The statistical tests draw many seeded samples and compare the empirical
distribution with the exact target distribution by a chi-square test. Each is
run against deliberately broken acceptance rules too, which must fail it:
otherwise the test could not tell a correct sampler from a wrong one.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tandem.sampling import SamplingParams, probabilities
from tandem.spec.rejection import Verdict, verify, verify_greedy, verify_sampled
from tests.spec.losslessness import SIGNIFICANCE, chi_square_pvalue, exact_two_token_distribution, one_torch_thread


def one_hot_logits(tokens: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.full((len(tokens), vocab), -5.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_perfect_match_gives_bonus():
    assert verify_greedy(one_hot_logits([3, 4, 5, 6]), [3, 4, 5]) == Verdict(3, 6)


def test_greedy_early_mismatch_gives_correction():
    assert verify_greedy(one_hot_logits([3, 4, 5, 6]), [3, 9, 5]) == Verdict(1, 4)
    assert verify_greedy(one_hot_logits([3, 4, 5, 6]), [8, 4, 5]) == Verdict(0, 3)


def test_empty_draft_is_plain_decoding():
    assert verify_greedy(one_hot_logits([7]), []) == Verdict(0, 7)
    params = SamplingParams(temperature=1.0, seed=0)
    verdict = verify(one_hot_logits([7]) * 10, [], None, params, params.make_generator())
    assert verdict == Verdict(0, 7)


def test_sampled_verification_is_deterministic_per_seed():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    q = torch.softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(1)), -1)
    params = SamplingParams(temperature=1.0, seed=42)
    runs = [verify_sampled(logits, [1, 2, 3], q, params, params.make_generator()) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


# ----- the statistical test, on the rejection sampler alone ------------------

def emitted_first_token(p_logits: torch.Tensor, q: torch.Tensor, seed: int, rule) -> int:
    """Draft one token from q, verify it against p; the token that ends up at that position."""
    gen = torch.Generator().manual_seed(seed)
    draft = int(torch.multinomial(q, 1, generator=gen))
    verdict = rule(p_logits, [draft], q[None], SamplingParams(temperature=1.0), gen)
    return draft if verdict.num_accepted == 1 else verdict.next_token


def broken_always_accept(target_logits, draft_tokens, draft_probs, params, generator):
    return Verdict(len(draft_tokens), 0)


def broken_resample_from_p(target_logits, draft_tokens, draft_probs, params, generator):
    """Rejects like the real rule but resamples from p instead of normalize(max(0, p - q))."""
    verdict = verify_sampled(target_logits, draft_tokens, draft_probs, params, generator)
    if verdict.num_accepted < len(draft_tokens):
        p = torch.softmax(target_logits[verdict.num_accepted], -1)
        return Verdict(verdict.num_accepted, int(torch.multinomial(p, 1, generator=generator)))
    return verdict


# Requests per end-to-end case in make test; the long tier runs 4000. Measured at 4000, each broken
# rule moves the law by a chi-square noncentrality of about 0.17 per sample: 140 at 800 requests,
# which a test at SIGNIFICANCE misses with probability about 5e-10.
LOOP_SAMPLES = 800

P_LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0] * 6])  # row 1: the bonus position
Q = torch.tensor([0.05, 0.4, 0.3, 0.05, 0.15, 0.05])
MIN_P = 0.3  # the end-to-end min-p case's filter


@pytest.mark.parametrize("rule,lossless", [
    (verify_sampled, True),
    (broken_always_accept, False),
    (broken_resample_from_p, False),
], ids=["correct", "always-accept", "resample-from-p"])
def test_rejection_sampler_output_follows_target(rule, lossless):
    with one_torch_thread():
        samples = [emitted_first_token(P_LOGITS, Q, seed, rule) for seed in range(8000)]
    pvalue = chi_square_pvalue(samples, torch.softmax(P_LOGITS[0], -1).numpy())
    assert (pvalue > SIGNIFICANCE) == lossless, f"p-value {pvalue:.2e}"


# ----- the statistical test end to end, through draft and target models -----

@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """A target and an unrelated draft with 6 tokens, so two-token outcomes fit a chi-square table."""
    from tests.tiny_models import save_tiny_model

    kw = dict(vocab_size=6, bos_token_id=0, eos_token_id=1)
    target = save_tiny_model(tmp_path_factory.mktemp("t6"), "qwen2", seed=3, **kw)
    draft = save_tiny_model(tmp_path_factory.mktemp("d6"), "qwen2", seed=4, **kw)
    return target, draft


def sample_through_the_loop(pair, monkeypatch, lossless: bool, draft_options: dict, tree: str,
                            n: int, min_p: float = 0.0) -> tuple[list[int], np.ndarray]:
    """Tokens 2 and 3 (``t2 * 6 + t3``) of n seeded requests through the loop, and their exact law under the target."""
    import target_worker.engine as target_engine_module
    from tandem.config import EngineConfig
    from tandem.engine import ModelEngine
    from tandem.inprocess import GenerationRequest, SpeculativeGenerator
    from tandem.spec.options import SpecOptions

    target_dir, draft_dir = pair
    cfg = dict(dtype="float32", kv_cache_tokens=65536, block_size=4)
    target = ModelEngine.load(EngineConfig(target_dir, **cfg))
    draft = ModelEngine.load(EngineConfig(draft_dir, **cfg, **draft_options))
    prompt, temperature = [0, 3, 2, 5], 1.0
    if not lossless and min_p:  # the target forgets min-p (the draft still applies it)
        from tandem.spec import rejection

        monkeypatch.setattr(rejection, "probabilities", lambda logits, params: probabilities(
            logits, dataclasses.replace(params, min_p=0.0)))
    elif not lossless and tree == "on":  # a rejected candidate's mass stays in the residual
        from tandem.spec import rejection

        monkeypatch.setattr(rejection, "_without", lambda residual, token, q: residual)
    elif not lossless:
        broken = lambda logits, tokens, probs, params, gen, position=None, raw=None: (  # noqa: E731
            broken_resample_from_p(logits, tokens, probs, params, gen) if tokens
            else verify(logits, tokens, probs, params, gen, position=position, raw=raw))
        monkeypatch.setattr(target_engine_module, "verify", broken)
    # Token 1 comes from the target's prefill, tokens 2 and 3 from speculative rounds.
    # rejection_rule: the rule under test (a seeded request is otherwise kept to its own seeded draws)
    requests = [GenerationRequest(prompt, max_new_tokens=4,
                                  sampling=SamplingParams(temperature, seed=s, rejection_rule=True, min_p=min_p))
                for s in range(n)]
    options = SpecOptions("draft", 2, adaptive_k=False, tree=tree, tree_width=2)
    with one_torch_thread():
        results = SpeculativeGenerator(target, draft, options).generate(requests)
    assert all(r.stats.k_counts[2] >= 1 for r in results)  # tokens 2-3 come from a k=2 round (or k=1 after it)
    assert all((r.stats.tree_rounds >= 1) == (tree == "on") for r in results)
    samples = [r.token_ids[1] * 6 + r.token_ids[2] for r in results]
    return samples, exact_two_token_distribution(target, prompt, temperature, min_p=min_p)


@pytest.mark.parametrize("n", [LOOP_SAMPLES, pytest.param(4000, marks=pytest.mark.long)], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("lossless,draft_options,tree", [
    (True, {}, "off"),
    # q is 0 on ids 4 and 5 and int8-rounded elsewhere: still lossless, since q is what the draft sampled from.
    (True, {"quantization": "int8", "vocab_limit": 4}, "off"),
    (False, {}, "off"),
    # token trees: the sampled chain plus the draft's next-best tokens under the multi-candidate rule
    (True, {}, "on"),
    (False, {}, "on"),
], ids=["correct", "correct-lean-draft", "broken-resample-from-p", "correct-tree", "broken-tree-no-residual"])
def test_speculative_sampling_matches_target_distribution_end_to_end(small_vocab_pair, monkeypatch, lossless,
                                                                     draft_options, tree, n):
    """In process, through the one loop and the worker engines (the wire format included)."""
    samples, law = sample_through_the_loop(small_vocab_pair, monkeypatch, lossless, draft_options, tree, n)
    pvalue = chi_square_pvalue(samples, law)
    assert (pvalue > SIGNIFICANCE) == lossless, f"p-value {pvalue:.2e}"


@pytest.mark.parametrize("lossless,tree", [(True, "off"), (True, "on"), (False, "off")],
                         ids=["correct", "correct-tree", "broken-target-forgets-min-p"])
def test_min_p_sampling_matches_the_targets_filtered_distribution(small_vocab_pair, monkeypatch, lossless, tree):
    """min-p (vLLM's): the output follows the target's law after the filter, chains and trees; a target that
    verifies without the filter the draft applied fails."""
    samples, law = sample_through_the_loop(small_vocab_pair, monkeypatch, lossless, {}, tree, LOOP_SAMPLES,
                                           min_p=MIN_P)
    assert (law == 0).any()  # the filter drops outcomes here
    pvalue = chi_square_pvalue(samples, law)
    assert (pvalue > SIGNIFICANCE) == lossless, f"p-value {pvalue:.2e}"
