"""Sampling through real draft and target worker processes follows the target's own distribution.

A 6-token target and an unrelated 6-token draft run as real worker processes
behind a real coordinator, talking gRPC. Thousands of seeded requests sample
three tokens each at T=1; the second and third come from a speculative round
with k=2, whose drafts travel as the wire's sparse q. Their joint frequency
must match the target's exact distribution P(t2, t3) (a chi-square test).

The companions show the test would catch the defect it guards against: with a
coarse wire format (so that the effect is large enough to see) sent once, the
output still follows the target; with the draft re-encoding the q it sampled
from before sending it (the double encoding), it does not.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem.client import TandemClient, build_request
from tandem.cluster import ClusterSpec, LocalCluster
from tandem.sampling import SamplingParams
from tests.spec.test_rejection import SIGNIFICANCE, chi_square_pvalue, exact_two_token_distribution
from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.slow

VOCAB, PROMPT, TEMPERATURE, SAMPLES = 6, [0, 3, 2, 5], 1.0, 4000
FAULTY_DRAFT = ("-m", "tests.integration.faulty_draft_worker", "--fault")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A target and an unrelated draft with 6 tokens and a real (tiny) tokenizer, as model directories."""
    kw = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1)
    dirs = []
    for name, seed in (("target", 3), ("draft", 4)):
        path = save_tiny_model(tmp_path_factory.mktemp(name), "qwen2", seed=seed, **kw)
        save_tiny_tokenizer(path, VOCAB, eos_token_id=1, bos_token_id=0)
        dirs.append(path)
    return dirs


@pytest.fixture(scope="module")
def expected(pair):
    from tandem.config import EngineConfig
    from tandem.engine import ModelEngine

    target = ModelEngine.load(EngineConfig(pair[0], dtype="float32", kv_cache_tokens=4096, block_size=4))
    return exact_two_token_distribution(target, PROMPT, TEMPERATURE)


def sample_through_services(pair, log_dir, draft_command: tuple[str, ...] | None,
                            tree: str = "off") -> tuple[list[int], int, int, int]:
    """(t2 * VOCAB + t3) per seeded request, the drafted / accepted token totals and the tree rounds."""
    target_dir, draft_dir = pair
    spec = ClusterSpec(target=str(target_dir), draft=str(draft_dir), dtype="float32", kv_cache_tokens=65536,
                       log_dir=log_dir, draft_args=("--quantization", "none", "--vocab", "0"),
                       **({"draft_command": draft_command} if draft_command else {}))
    with LocalCluster(spec) as cluster, TandemClient(cluster.coordinator.address, timeout_s=120) as client:
        def one(seed: int):
            # 4 tokens: the first from the prefill, the next two from one k=2 round (or a k=1 round after it)
            request = build_request(PROMPT, max_new_tokens=4, sampling=SamplingParams(TEMPERATURE, seed=seed),
                                    method="draft", k=2, fixed_k=True, ignore_eos=True, tree=tree)
            return client.generate(request)

        with ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(one, range(SAMPLES)))
    samples = [r.token_ids[1] * VOCAB + r.token_ids[2] for r in replies]
    stats = [r.stats for r in replies]
    return (samples, sum(s.drafted for s in stats), sum(s.accepted for s in stats),
            sum(s.tree_rounds for s in stats))


@pytest.mark.parametrize("draft_command,lossless,tree", [
    (None, True, "off"),  # the real wire format, the real draft worker
    ((*FAULTY_DRAFT, "coarse"), True, "off"),  # a coarse format, sent exactly once: still lossless
    ((*FAULTY_DRAFT, "double-encoding"), False, "off"),  # the q sent is not the q sampled from: caught
    # token trees: the sampled chain and the draft's next-best tokens (point masses) under the tree rule
    (None, True, "on"),
], ids=["fp16-wire", "coarse-wire-once", "coarse-wire-double-encoded", "fp16-wire-trees"])
def test_sampling_through_workers_follows_the_target(pair, expected, tmp_path, draft_command, lossless, tree):
    samples, drafted, accepted, tree_rounds = sample_through_services(pair, tmp_path, draft_command, tree)
    assert drafted >= SAMPLES and 0 < accepted < drafted  # the drafts were judged, and some rejected
    assert (tree_rounds >= SAMPLES) == (tree == "on")
    pvalue = chi_square_pvalue(samples, expected)
    assert (pvalue > SIGNIFICANCE) == lossless, f"p-value {pvalue:.2e}"
