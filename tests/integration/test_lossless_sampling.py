"""Sampling through real draft and target worker processes follows the target's own distribution.

A 6-token target and an unrelated 6-token draft run as real worker processes
behind a real coordinator, talking gRPC. Seeded requests sample three tokens
each; the second and third come from a speculative round with k=2 (or a
round after it), whose drafts travel as the wire's sparse q. Their joint
frequency must match the target's exact distribution P(t2, t3) (a chi-square
test). The statistics themselves are tested in process, where they are cheap
(tests/spec/test_lossless_wire.py, tests/draft_worker/test_lossless.py);
here the point is the path end to end: processes, gRPC, the coordinator.

``make test`` runs one system with the real draft worker, chains and token
trees through it, and its failing companion: the same system whose draft
worker re-encodes the q it sampled from before sending it (the double
encoding, ``tests.integration.faulty_draft_worker``). The pair, prompt and
temperature (``tests.spec.losslessness``) make the double encoding plain in
``PAIR_SAMPLES`` = 500 requests. The long tier runs the former full test:
4000 requests per system at T = 1 with another pair, the real wire format,
the coarse format sent once (which must pass), the double encoding and trees.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tandem.client import TandemClient, build_request
from tandem.cluster import ClusterSpec, LocalCluster
from tandem.sampling import SamplingParams
from tests.spec.losslessness import (
    PAIR_PROMPT,
    PAIR_SAMPLES,
    PAIR_TEMPERATURE,
    PAIR_VOCAB,
    SIGNIFICANCE,
    chi_square_pvalue,
    exact_two_token_distribution,
    save_six_token_pair,
)

pytestmark = pytest.mark.slow

FAULTY_DRAFT = ("-m", "tests.integration.faulty_draft_worker", "--fault")
# The long tier: the pair and temperature of the full test as it was, 4000 requests per system.
FULL_SEEDS, FULL_TEMPERATURE, FULL_SAMPLES = (3, 4), 1.0, 4000


def exact_law(target_dir: Path, temperature: float) -> np.ndarray:
    """P(t2, t3) of the target alone."""
    from tandem.config import EngineConfig
    from tandem.engine import ModelEngine

    target = ModelEngine.load(EngineConfig(target_dir, dtype="float32", kv_cache_tokens=4096, block_size=4))
    return exact_two_token_distribution(target, PAIR_PROMPT, temperature)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return save_six_token_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def law(pair) -> np.ndarray:
    return exact_law(pair[0], PAIR_TEMPERATURE)


@contextmanager
def serving(pair: tuple[Path, Path], log_dir: Path, draft_command: tuple[str, ...] | None) -> Iterator[TandemClient]:
    """A real target worker, draft worker (``draft_command``: a faulty one) and coordinator; a client of it."""
    target_dir, draft_dir = pair
    spec = ClusterSpec(target=str(target_dir), draft=str(draft_dir), dtype="float32", kv_cache_tokens=65536,
                       log_dir=log_dir, draft_args=("--quantization", "none", "--vocab", "0"),
                       **({"draft_command": draft_command} if draft_command else {}))
    with LocalCluster(spec) as cluster, TandemClient(cluster.coordinator.address, timeout_s=120) as client:
        yield client


@dataclass(slots=True)
class Sampled:
    tokens: list[int]  # t2 * PAIR_VOCAB + t3, one per request
    drafted: int
    accepted: int
    tree_rounds: int


def sample(client: TandemClient, tree: str, samples: int, temperature: float) -> Sampled:
    """Tokens 2 and 3 of ``samples`` seeded requests, and the drafted / accepted / tree-round totals."""
    def one(seed: int):
        # 4 tokens: the first from the prefill, the next two from one k=2 round (or a round after it)
        # rejection_rule: the rule under test (a seeded request is otherwise kept to its own seeded draws)
        sampling = SamplingParams(temperature, seed=seed, rejection_rule=True)
        request = build_request(PAIR_PROMPT, max_new_tokens=4, sampling=sampling,
                                method="draft", k=2, fixed_k=True, ignore_eos=True, tree=tree)
        return client.generate(request)

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(one, range(samples)))
    stats = [r.stats for r in replies]
    return Sampled([r.token_ids[1] * PAIR_VOCAB + r.token_ids[2] for r in replies], sum(s.drafted for s in stats),
                   sum(s.accepted for s in stats), sum(s.tree_rounds for s in stats))


def check(sampled: Sampled, law: np.ndarray, tree: str, lossless: bool) -> None:
    """The drafts were judged (some rejected), trees ran when asked, and the chi-square verdict is ``lossless``."""
    samples = len(sampled.tokens)
    assert sampled.drafted >= samples and 0 < sampled.accepted < sampled.drafted
    assert (sampled.tree_rounds >= samples) == (tree == "on")
    pvalue = chi_square_pvalue(sampled.tokens, law)
    assert (pvalue > SIGNIFICANCE) == lossless, f"p-value {pvalue:.2e}"


@pytest.fixture(scope="module")
def real_workers(pair, tmp_path_factory) -> Iterator[TandemClient]:
    """One system with the real draft worker, for chains and trees."""
    with serving(pair, tmp_path_factory.mktemp("logs"), None) as client:
        yield client


@pytest.mark.parametrize("tree", ["off", "on"], ids=["chain", "tree"])
def test_sampling_through_real_workers_follows_the_target(real_workers, law, tree):
    check(sample(real_workers, tree, PAIR_SAMPLES, PAIR_TEMPERATURE), law, tree, lossless=True)


def test_double_encoding_in_a_real_draft_worker_is_caught(pair, law, tmp_path):
    """The companion: the same requests, the draft worker sending a q it did not sample from."""
    with serving(pair, tmp_path, (*FAULTY_DRAFT, "double-encoding")) as client:
        sampled = sample(client, "off", PAIR_SAMPLES, PAIR_TEMPERATURE)
    check(sampled, law, "off", lossless=False)


@pytest.fixture(scope="module")
def full_pair(tmp_path_factory) -> tuple[Path, Path]:
    return save_six_token_pair(tmp_path_factory.mktemp("full-pair"), FULL_SEEDS)


@pytest.fixture(scope="module")
def full_law(full_pair) -> np.ndarray:
    return exact_law(full_pair[0], FULL_TEMPERATURE)


@pytest.mark.long
@pytest.mark.parametrize("draft_command,lossless,tree", [
    (None, True, "off"),  # the real wire format, the real draft worker
    ((*FAULTY_DRAFT, "coarse"), True, "off"),  # a coarse format, sent exactly once: still lossless
    ((*FAULTY_DRAFT, "double-encoding"), False, "off"),  # the q sent is not the q sampled from: caught
    # token trees: the sampled chain and the draft's next-best tokens (point masses) under the tree rule
    (None, True, "on"),
], ids=["fp16-wire", "coarse-wire-once", "coarse-wire-double-encoded", "fp16-wire-trees"])
def test_full_sampling_through_workers_follows_the_target(full_pair, full_law, tmp_path, draft_command, lossless,
                                                           tree):
    with serving(full_pair, tmp_path, draft_command) as client:
        sampled = sample(client, tree, FULL_SAMPLES, FULL_TEMPERATURE)
    check(sampled, full_law, tree, lossless)
