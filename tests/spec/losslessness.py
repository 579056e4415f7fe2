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
    expected = probs / probs.sum() * len(samples)
    keep = expected >= 5  # merge rare outcomes into one bin so the chi-square approximation holds
    observed = np.append(counts[keep], counts[~keep].sum())
    expect = np.append(expected[keep], expected[~keep].sum())
    if expect[-1] == 0:
        observed, expect = observed[:-1], expect[:-1]
    return float(chisquare(observed, expect).pvalue)


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
                                 adjust: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None) -> np.ndarray:
    """P(t2, t3) of the target ``ModelEngine`` alone, marginalised over t1, as a flat [vocab * vocab] array.

    ``adjust(logits, generated)``: the request's logit processing (penalties) of the ``[vocab]`` logits after
    the prompt and the tokens ``generated`` so far; None: none."""
    from tandem.engine import ForwardItem

    vocab = engine.config.vocab_size

    def dist(tokens: list[int]) -> np.ndarray:
        logits = engine.forward([ForwardItem("exact", tokens)])[0][0]
        engine.release("exact")
        if adjust is not None:
            logits = adjust(logits, tokens[len(prompt):])
        return torch.softmax(logits / temperature, -1).double().numpy()

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
