"""The one real-model cluster that every test needing only a running system shares.

Starting a SmolLM2 process costs seconds of both shared cores (importing torch, loading, warming
up), so the suite starts one system per run (per pytest worker: `make test` runs two, each starting it
when the first test it runs needs it), and the tests that only send requests use it: two target
replicas and two draft replicas of SmolLM2 in ``SHARED_DTYPE`` (the draft at full precision and full
vocabulary, so it is the target's own model and every draft token is accepted, which tests assert),
pipelined drafting on, one coordinator, metrics on, everything bound to 127.0.0.1, the workers' spans
of traced calls sent to a real OTLP receiver in the test process (``otlp_collector``). A test that
needs other coordinator settings adds a coordinator of its own over the same workers
(``extra_coordinator``); only a test that kills, hangs or reconfigures workers starts a cluster
of its own (on the tiny model where the property is not about real text).

The references (target-only greedy output of SmolLM2, computed in process) are session-scoped
too, so each is computed once per run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from tandem.client import TandemClient
from tandem.cluster import ClusterSpec, LocalCluster, Service
from tandem.config import native_cpu_bf16
from tests.otlp_collector import OtlpCollector
from tests.references import target_only

# The dtype a user gets by default here (``--dtype auto``): bf16 where the CPU multiplies it natively, else
# fp32. Where bf16 is emulated (AVX2 or AVX-512 without avx512_bf16), SmolLM2 drafting for itself with k=4
# wrote a 40-token answer in 12.6 s in bf16 against 5.0 s in fp32 (packed weights; AMD EPYC Zen 3), and most
# shared-cluster tests speculate. ``OTHER_DTYPE``'s own system (test_services) covers the dtype left out.
SHARED_DTYPE = "bfloat16" if native_cpu_bf16() else "float32"
OTHER_DTYPE = "float32" if SHARED_DTYPE == "bfloat16" else "bfloat16"

# What the shared-cluster tests ask for, and the references are computed for (chat template, 40 tokens).
PROMPTS = (
    "Write a story about a cat.",
    "def fibonacci(n):",
    "List the planets of the solar system.",
    "Explain what a hash table is.",
)
MAX_NEW_TOKENS = 40


@pytest.fixture(scope="session")
def otlp_collector() -> Iterator[OtlpCollector]:
    """A real OTLP/gRPC receiver the shared cluster's workers send their call spans to (only calls of a traced
    request make spans: those of a coordinator started with --otlp-traces-endpoint)."""
    with OtlpCollector() as collector:
        yield collector


@pytest.fixture(scope="session")
def shared_cluster(smollm2_dir, tmp_path_factory, otlp_collector) -> Iterator[LocalCluster]:
    spec = ClusterSpec(target=str(smollm2_dir), draft=str(smollm2_dir), dtype=SHARED_DTYPE, kv_cache_tokens=8192,
                       target_replicas=2, draft_replicas=2, worker_threads=1,
                       log_dir=tmp_path_factory.mktemp("shared-cluster-logs"), pipelining=True,
                       worker_args=("--host", "127.0.0.1", "--otlp-traces-endpoint", otlp_collector.endpoint),
                       # The OpenAI-compatible HTTP API too, so that its tests share this cluster.
                       coordinator_args=("--host", "127.0.0.1", "--http-port", "0"),
                       # A full-precision draft equal to the target: every draft is accepted, which tests assert.
                       draft_args=("--quantization", "none", "--vocab", "0"))
    with LocalCluster(spec) as running:
        yield running


@pytest.fixture(scope="session")
def shared_client(shared_cluster) -> Iterator[TandemClient]:
    with TandemClient(shared_cluster.coordinator.address, timeout_s=120) as client:
        yield client


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_dir) -> dict[str, list[int]]:
    """SmolLM2's target-only greedy output in the shared system's dtype for each of PROMPTS."""
    return target_only(smollm2_dir, PROMPTS, dtype=SHARED_DTYPE, max_new_tokens=MAX_NEW_TOKENS)


@contextlib.contextmanager
def extra_coordinator(cluster: LocalCluster, extra_args: tuple[str, ...] = ()) -> Iterator[Service]:
    """One more coordinator over ``cluster``'s workers, with settings of its own; stopped (and taken out
    of the cluster's services) afterwards, so the next test finds the cluster as it was."""
    coordinator = cluster.add_coordinator(extra_args=extra_args)
    try:
        yield coordinator
    finally:
        cluster.services.remove(coordinator)
        LocalCluster._terminate([coordinator], grace_s=15.0)
