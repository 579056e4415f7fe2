"""The chi-square test the losslessness tests share: observed tokens against the target's exact law.

Every statistical test of the suite draws seeded samples and compares their
frequencies with exact probabilities; each is run against a known defect too,
which must fail it (otherwise the test could not tell a correct sampler from
a wrong one). ``SIGNIFICANCE`` is the false-alarm rate of a correct sampler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.stats import chisquare

SIGNIFICANCE = 1e-3

# The six-token pair that the engine test (tests/draft_worker/test_lossless.py) and the worker-process
# test (tests/integration/test_lossless_sampling.py) run: a target and an unrelated draft, small enough
# that the law of two tokens is a 36-cell table. Seeds, prompt and temperature are where the double
# encoding of tests.integration.faulty_draft_worker shows most among those tried: computed exactly
# from the models, it moves the law of (t2, t3) by a chi-square noncentrality of 144 at 500 samples
# (12 degrees of freedom), which a test at SIGNIFICANCE misses with probability 2e-12.
PAIR_VOCAB, PAIR_SEEDS, PAIR_PROMPT, PAIR_TEMPERATURE, PAIR_SAMPLES = 6, (5, 8), [0, 3, 2, 5], 0.45, 500


def chi_square_pvalue(samples: list[int], probs: np.ndarray) -> float:
    """p-value of ``samples`` (outcome indices) under the law ``probs`` (any positive scale)."""
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    if counts[probs == 0].any():  # an outcome the law forbids (a filtered token) was drawn: not this law
        return 0.0
    expected = probs / probs.sum() * len(samples)
    observed, expect = pooled(counts, expected)
    return float(chisquare(observed, expect).pvalue)


def pooled(counts: np.ndarray, expected: np.ndarray, least: float = 5.0) -> tuple[np.ndarray, np.ndarray]:
    """Counts and expectations with the rare outcomes merged into one bin that itself expects ``least`` or more
    (the chi-square approximation's condition), taking in the next rarest outcomes while it expects fewer.

    A pooled bin left below ``least`` breaks the approximation: 2 draws where 0.2 were expected read as
    p = 8e-5, while the exact chance of 2 or more is 1.8 %. A near-deterministic law on a GPU failed so (2026-12-04).
    """
    order = np.argsort(expected, kind="stable")  # rarest first
    sorted_expected = expected[order]
    rare = int(np.searchsorted(sorted_expected, least))  # outcomes expecting fewer than ``least``
    if rare == 0:
        return counts[order], sorted_expected
    while rare < len(order) and sorted_expected[:rare].sum() < least:
        rare += 1
    if rare >= len(order):  # every outcome in the pool: one bin, no test to make
        raise ValueError(f"too few samples for a chi-square test: {expected.sum():.0f} over {len(order)} outcomes")
    pool = sorted_expected[:rare].sum()
    observed = np.append(counts[order][rare:], counts[order][:rare].sum())
    expect = np.append(sorted_expected[rare:], pool)
    return (observed, expect) if pool > 0 else (observed[:-1], expect[:-1])


def save_six_token_pair(root: Path, seeds: tuple[int, int] = PAIR_SEEDS) -> tuple[Path, Path]:
    """Write the target and the draft (``seeds``) under ``root``, each with a real tokenizer; their directories."""
    from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

    dirs = []
    for name, seed in zip(("target", "draft"), seeds):
        path = save_tiny_model(root / name, "qwen2", seed=seed, vocab_size=PAIR_VOCAB, bos_token_id=0, eos_token_id=1)
        save_tiny_tokenizer(path, PAIR_VOCAB, eos_token_id=1, bos_token_id=0)
        dirs.append(path)
    return dirs[0], dirs[1]


def exact_two_token_distribution(engine, prompt: list[int], temperature: float,
                                 adjust: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None,
                                 min_p: float = 0.0) -> np.ndarray:
    """P(t2, t3) of the target ``ModelEngine`` alone, marginalised over t1, as a flat [vocab * vocab] array.

    ``adjust(logits, generated)``: the request's logit processing (penalties) of the ``[vocab]`` logits after
    the prompt and the tokens ``generated`` so far; None: none. ``min_p``: tokens less likely than that times the
    likeliest are dropped after temperature (computed here on its own, not by ``tandem.sampling``)."""
    from tandem.engine import ForwardItem

    vocab = engine.config.vocab_size

    def dist(tokens: list[int]) -> np.ndarray:
        logits = engine.forward([ForwardItem("exact", tokens)])[0][0]
        engine.release("exact")
        if adjust is not None:
            logits = adjust(logits, tokens[len(prompt):])
        probs = torch.softmax(logits.double() / temperature, -1).cpu().numpy()
        probs[probs < min_p * probs.max()] = 0.0
        return probs / probs.sum()

    joint = np.zeros((vocab, vocab))
    p1 = dist(prompt)
    for t1 in range(vocab):
        p2 = dist([*prompt, t1])
        for t2 in range(vocab):
            joint[t2] += p1[t1] * p2[t2] * dist([*prompt, t1, t2])
    return joint.reshape(-1)


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run torch on one thread: sampling loops are many tiny ops, and a pool of threads waiting on each
    other is several times slower, far more so on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _ok(results: list) -> list:
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]
    return results


def point_masses(tokens: list[int]) -> list:
    from tandem.rpc import distributions

    return distributions.encode_distributions(torch.nn.functional.one_hot(torch.tensor(tokens), PAIR_VOCAB).float())


def two_and_three(target, draft, prompt: list[int], sampling_of: Callable[[int], Any], seeds: range,
                  tree: bool) -> list[int]:
    """Tokens 2 and 3 (``t2 * PAIR_VOCAB + t3``) per seed, through a ``TargetEngine`` and a ``DraftEngine``: a
    prefill, one round of 2 sampled drafts (a tree adds the draft's next-best token at both depths, as
    deterministic leaves), then single-token rounds. ``sampling_of(seed)``: each request's SamplingParams."""
    from draft_worker.engine import ProposeCall
    from tandem.rpc.calls import ReleaseCall
    from target_worker.engine import PrefillCall, VerifyCall

    ids = [f"s{seed}" for seed in seeds]
    sampling = {i: sampling_of(seed) for i, seed in zip(ids, seeds)}
    first = [p.next_token for p in _ok(target.run_batch([PrefillCall(i, prompt, sampling[i]) for i in ids]))]
    proposals = _ok(draft.run_batch([ProposeCall(i, 0, [*prompt, t1], 2, sampling[i], alternatives=int(tree))
                                    for i, t1 in zip(ids, first)]))
    calls = []
    for i, p in zip(ids, proposals):
        if tree:  # node 0, 1: the sampled chain; node 2 hangs on the root, node 3 on node 0
            alts = [p.alternatives[0][0], p.alternatives[1][0]]
            calls.append(VerifyCall(i, len(prompt) + 1, [*p.tokens, *alts], [*p.probs, *point_masses(alts)],
                                    [-1, 0, -1, 0]))
        else:
            calls.append(VerifyCall(i, len(prompt) + 1, p.tokens, p.probs))
    out = {i: [call.draft_tokens[n] for n in v.accepted_nodes] + [v.next_token]
           for i, call, v in zip(ids, calls, _ok(target.run_batch(calls)))}
    while short := [i for i in ids if len(out[i]) < 2]:  # a plain round: the target's next token
        for i, v in zip(short, _ok(target.run_batch([VerifyCall(i, len(prompt) + 1 + len(out[i]), [], [])
                                                    for i in short]))):
            out[i].append(v.next_token)
    _ok(target.run_batch([ReleaseCall(i) for i in ids]))
    _ok(draft.run_batch([ReleaseCall(i) for i in ids]))
    return [out[i][0] * PAIR_VOCAB + out[i][1] for i in ids]


# How the per-row tests (penalties, structured output) run each rule: with an unrelated draft (most drafts
# rejected: the residuals), with the target drafting for itself (most kept), and that again with every row
# blind to the drafts on its path (the defect, which must fail).
PER_ROW_DRAFTERS = dict(argnames="drafter,defect,lossless",
                        argvalues=[("unrelated", False, True), ("target", False, True), ("target", True, False)],
                        ids=["unrelated-draft", "target-as-draft", "target-as-draft-rows-blind-to-drafts"])


def per_row_pvalue(pair: tuple[Path, Path], monkeypatch, drafter: str, defect: bool, make_target: Callable,
                   prompt: list[int], sampling_of: Callable[[int], Any], reference: Callable, n: int, tree: bool,
                   seed_base: int = 0) -> float:
    """The p-value of tokens 2 and 3 of ``n`` seeded runs (seeds from ``seed_base``) through ``make_target(dir)``
    (a TargetEngine) and a DraftEngine, against the target's exact law under ``reference`` (the rule by hand)."""
    import target_worker.engine
    from draft_worker.engine import DraftEngine
    from tandem.config import EngineConfig
    from tandem.engine import ModelEngine

    if defect:
        monkeypatch.setattr(target_worker.engine, "row_paths_of", lambda drafts, parents: [[]] * (len(drafts) + 1))
    target_dir, draft_dir = pair
    target = make_target(target_dir)
    draft = DraftEngine(ModelEngine.load(EngineConfig(target_dir if drafter == "target" else draft_dir,
                                                      dtype="float32", kv_cache_tokens=16384, block_size=4)))
    with one_torch_thread():
        seeds = [range(seed_base + start, seed_base + min(start + 500, n)) for start in range(0, n, 500)]
        samples = [s for chunk in seeds for s in two_and_three(target, draft, prompt, sampling_of, chunk, tree)]
    assert target.num_sequences == draft.num_sequences == 0
    return chi_square_pvalue(samples, exact_two_token_distribution(target.engine, prompt, PAIR_TEMPERATURE, reference))
