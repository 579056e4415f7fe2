"""The target's speculation heads through the services: real worker processes, gRPC, the coordinator.

A target worker started with ``--heads`` (Tandem's layout, written here for a tiny target with
``save_heads``) and a coordinator. Greedy (with a draft worker of the same model beside them):
requests for ``medusa`` / ``eagle`` stream the target-only tokens, ``auto`` picks the heads (and
runs hybrid rounds with the draft model while they measure slower), the coordinator's Info names
them, and a request for the other kind is refused by name. Sampling (no draft model): the six-token
target of tests/integration/test_lossless_sampling.py serves Medusa or EAGLE-3 heads, and seeded requests'
tokens 2 and 3 must follow the target's exact law (chi-square): the heads' nodes are deterministic,
chains and trees verified by the multi-candidate rule, one RPC a round. The requests fix the heads'
tree (``fixed_k``, ``heads_nodes``), so that their rounds, and with them each seed's draws, do not
follow measured costs: the p-value is the same in every run (medusa 0.32, eagle 0.19). At
``PAIR_SAMPLES`` the test fails (both kinds) when a deterministic node is kept whenever p(x) > 0
(p-value 0), when siblings are judged against p rather than the residual their rejected elder
siblings leave (p < 1e-6), or when a rejected node is left in the residual (p < 1e-7). The rule's
statistics in process are tests/spec's; the point here is the path end to end.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest

from tandem.client import TandemClient, build_request
from tandem.cluster import ClusterSpec, LocalCluster
from tandem.config import EngineConfig
from tandem.engine import ModelEngine
from tandem.heads.store import save_heads
from tandem.sampling import SamplingParams
from tests.heads.tiny_heads import tiny_heads
from tests.integration.faults import worker_info
from tests.integration.test_services import metric_samples
from tests.references import target_only
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

KINDS = ("medusa", "eagle")
PROMPTS = ([5, 17, 33], [9] * 8, list(range(10, 40)), [61])
NEW_TOKENS = 24
LONG_SAMPLES, LONG_TEMPERATURE = 4000, 1.0  # the long tier's chi-square


def load_target(model_dir: Path) -> ModelEngine:
    return ModelEngine.load(EngineConfig(model_dir, dtype="float32", kv_cache_tokens=4096, block_size=4))


@contextmanager
def serving_heads(model_dir: Path, heads_dir: Path, log_dir: Path, draft: Path | None = None,
                  metrics: bool = False) -> Iterator[tuple[LocalCluster, TandemClient]]:
    """One target worker serving the heads in ``heads_dir``, a coordinator, a draft worker of ``draft`` (if
    given); the cluster and a client of it."""
    spec = ClusterSpec(target=str(model_dir), draft=str(draft) if draft else None, dtype="float32",
                       kv_cache_tokens=65536, log_dir=log_dir, metrics=metrics,
                       target_args=("--heads", str(heads_dir)), worker_args=("--host", "127.0.0.1"),
                       coordinator_args=("--host", "127.0.0.1"))
    with LocalCluster(spec) as cluster, TandemClient(cluster.coordinator.address, timeout_s=120) as client:
        yield cluster, client


# ----- greedy ------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tiny_served_dir) -> dict[tuple[int, ...], list[int]]:
    return target_only(tiny_served_dir, PROMPTS, dtype="float32", max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=KINDS)
def heads_cluster(request, tiny_served_dir, tmp_path_factory) -> Iterator[tuple[str, LocalCluster, TandemClient]]:
    """(kind, cluster, client) of a tiny system whose target serves random heads of that kind."""
    kind = request.param
    heads_dir = tmp_path_factory.mktemp(f"{kind}-heads")
    save_heads(tiny_heads(load_target(tiny_served_dir), kind), heads_dir)
    with serving_heads(tiny_served_dir, heads_dir, tmp_path_factory.mktemp(f"{kind}-logs"),
                       draft=tiny_served_dir, metrics=True) as (cluster, client):
        yield kind, cluster, client


@pytest.fixture
def heads_service(heads_cluster) -> tuple[str, TandemClient]:
    """(kind, client) of ``heads_cluster``."""
    kind, _, client = heads_cluster
    return kind, client


def stream(client: TandemClient, prompt: list[int], method: str):
    """The streamed token ids of one greedy request, and its stats (on the last message)."""
    tokens, stats = [], None
    for chunk in client.stream(build_request(prompt, max_new_tokens=NEW_TOKENS, method=method, k=4,
                                             ignore_eos=True)):
        tokens += chunk.token_ids
        if chunk.HasField("stats"):
            stats = chunk.stats
    return tokens, stats


@pytest.mark.parametrize("method", ["named", "auto"])
def test_greedy_heads_through_services_are_the_targets(heads_service, reference, method):
    kind, client = heads_service
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: heads sequences batched in the worker
        results = list(pool.map(lambda p: stream(client, p, kind if method == "named" else "auto"), PROMPTS))
    assert [tokens for tokens, _ in results] == [reference[tuple(p)] for p in PROMPTS]
    assert all(stats.method == kind for _, stats in results)  # auto: the target's heads (hybrid between)
    assert all(stats.drafted > 0 for _, stats in results)  # the heads proposed; the rule kept only the target's


def test_heads_nodes_bounds_the_heads_tree(heads_service, reference):
    """``speculation.heads_nodes`` reaches the loop: one node a round (plus at most k = 1 of the text's own repeat)
    against eight; the output is the target's either way."""
    kind, client = heads_service
    prompt = PROMPTS[0]
    drafted_per_round = {}
    for nodes in (1, 8):
        request = build_request(prompt, max_new_tokens=NEW_TOKENS, method=kind, k=1, fixed_k=True,
                                heads_nodes=nodes, ignore_eos=True)
        reply = client.generate(request)
        assert list(reply.token_ids) == reference[tuple(prompt)]
        drafted_per_round[nodes] = reply.stats.drafted / reply.stats.rounds
    assert drafted_per_round[1] <= 2 < drafted_per_round[8]


def test_a_heads_request_starts_on_the_prefix_cache(heads_cluster, reference):
    """Medusa reads the last row alone; EAGLE's head keeps its own rows cached beside the target's blocks."""
    kind, cluster, client = heads_cluster
    prompt = PROMPTS[2]  # 30 tokens: its first send leaves its full blocks in both caches
    first, second = stream(client, prompt, kind), stream(client, prompt, kind)
    assert first[0] == second[0] == reference[tuple(prompt)]
    assert second[1].prompt_tokens_reused > 0
    (target,) = cluster.workers("target")
    info = worker_info(target)  # the worker's own, now (a coordinator's copy is as of its last poll)
    reused = metric_samples(target, "tandem_target_heads_prefix_cache_reused_tokens_total")
    if kind == "eagle":  # Info and the metrics count what the head's own cache gave: at least this send's reuse
        assert info.heads_prefix_cache.reused_tokens >= second[1].prompt_tokens_reused
        assert reused == {"tandem_target_heads_prefix_cache_reused_tokens_total": info.heads_prefix_cache.reused_tokens}
    else:
        assert not info.HasField("heads_prefix_cache") and not reused


def test_info_names_the_targets_heads(heads_service):
    kind, client = heads_service
    assert [w.info.heads for w in client.info().target_workers] == [kind]


def test_the_other_heads_method_is_refused_by_name(heads_service):
    kind, client = heads_service
    other = next(k for k in KINDS if k != kind)
    with pytest.raises(grpc.RpcError) as refused:
        client.generate(build_request(PROMPTS[0], max_new_tokens=4, method=other))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"needs the target's {other} heads; the target serves {kind} heads" in refused.value.details()
    assert "speculation.method" in refused.value.details()


# ----- sampling: chi-square ------------------------------------------------------
@pytest.fixture(scope="module")
def pair_target(tmp_path_factory) -> Path:
    return save_six_token_pair(tmp_path_factory.mktemp("pair"))[0]


@pytest.fixture(scope="module")
def pair_engine(pair_target) -> ModelEngine:
    """The six-token target in process: the exact law, and what its heads are made for."""
    return load_target(pair_target)


@pytest.fixture(scope="module", params=KINDS)
def pair_heads(request, pair_engine, tmp_path_factory) -> tuple[str, Path]:
    """(kind, directory) of random heads of that kind for the six-token target, in Tandem's layout."""
    heads_dir = tmp_path_factory.mktemp(f"pair-{request.param}")
    save_heads(tiny_heads(pair_engine, request.param), heads_dir)
    return request.param, heads_dir


def sample_with_heads(pair_target: Path, heads: tuple[str, Path], log_dir: Path, samples: int,
                      temperature: float) -> list:
    """The replies to ``samples`` seeded requests for 6 tokens each through a system serving ``heads``.

    6 tokens, not the 4 that t2 and t3 need: with room for more nodes the heads' proposals are
    trees (siblings judged in turn against the residual), not only chains."""
    kind, heads_dir = heads

    def one(seed: int):
        # rejection_rule: the rule under test (a seeded request is otherwise kept to its own seeded draws).
        # fixed_k and heads_nodes: every round asks for a 4-node tree, whatever the rounds measure, so that a seed's
        # draws, which follow its rounds, are the same in every run: the p-value is the same in every run.
        sampling = SamplingParams(temperature, seed=seed, rejection_rule=True)
        request = build_request(PAIR_PROMPT, max_new_tokens=6, sampling=sampling, method=kind, k=4,
                                fixed_k=True, heads_nodes=4, ignore_eos=True)
        return client.generate(request)

    with serving_heads(pair_target, heads_dir, log_dir) as (_, client), ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, range(samples)))


def check_follows_the_target(replies: list, kind: str, law: np.ndarray) -> None:
    """The heads' nodes were judged (some kept, some rejected, trees among them), and tokens 2 and 3 follow
    ``law`` at ``SIGNIFICANCE``."""
    stats = [r.stats for r in replies]
    drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
    assert {s.method for s in stats} == {kind}
    assert drafted >= len(replies) and 0 < accepted < drafted
    assert sum(s.tree_rounds for s in stats) > 0
    pvalue = chi_square_pvalue([r.token_ids[1] * PAIR_VOCAB + r.token_ids[2] for r in replies], law)
    assert pvalue > SIGNIFICANCE, f"p-value {pvalue:.2e}"


def test_sampling_with_heads_through_real_workers_follows_the_target(pair_target, pair_engine, pair_heads, tmp_path):
    replies = sample_with_heads(pair_target, pair_heads, tmp_path, PAIR_SAMPLES, PAIR_TEMPERATURE)
    law = exact_two_token_distribution(pair_engine, PAIR_PROMPT, PAIR_TEMPERATURE)
    check_follows_the_target(replies, pair_heads[0], law)


@pytest.mark.long
def test_full_sampling_with_heads_through_real_workers_follows_the_target(pair_target, pair_engine, pair_heads,
                                                                          tmp_path):
    """The long tier: 4000 requests at T = 1."""
    replies = sample_with_heads(pair_target, pair_heads, tmp_path, LONG_SAMPLES, LONG_TEMPERATURE)
    law = exact_two_token_distribution(pair_engine, PAIR_PROMPT, LONG_TEMPERATURE)
    check_follows_the_target(replies, pair_heads[0], law)
