"""A coordinator that follows EndpointSlices while it serves: a replica added, one removed, nothing lost.

No kube-apiserver can run here: the coordinator's real ``kubernetes`` client
talks to the stand-in of ``tests.kube_api_stub`` (the list/watch protocol over
HTTP), through a kubeconfig, as it would talk to a cluster. Two target worker
processes of the tiny served model (tests/tiny_models.py: the property is about
discovery, not text), one slice per worker (they share 127.0.0.1 and a slice's
port is all its endpoints' port). Greedy requests run one after another the
whole time, over prompts with different first blocks (the default prefix-aware
placement keeps one prompt on the replica its key prefers, so a single prompt
would never reach the added one): every one is answered, with its prompt's
tokens; the added replica gets requests; the removed one, once terminating, gets no new request and
drops out of the coordinator when its slice is deleted.
"""

from __future__ import annotations

import pytest

from tandem.client import TandemClient
from tandem.cluster import ClusterSpec, LocalCluster
from tests.integration.traffic import Traffic, until, until_used
from tests.kube_api_stub import KubeApiStub, endpoint, endpoint_slice

pytestmark = pytest.mark.slow

NS = "tandem"
# Twelve different first blocks: the chance that rendezvous hashing gives every one to the first replica is 2**-12.
PROMPTS = [f"Story {n:02d}: the cat and the dog." for n in range(12)]


def worker_slice(name: str, port: int, **conditions) -> dict:
    return endpoint_slice(f"targets-{name}", "targets", [endpoint("127.0.0.1", **conditions)], port)


def states(client: TandemClient) -> dict[str, str]:
    return {w.address: w.state for w in client.info().target_workers}


def test_a_replica_added_and_one_removed_during_a_run_with_every_request_answered(tiny_served_dir, tmp_path):
    spec = ClusterSpec(target=str(tiny_served_dir), draft=None, dtype="bfloat16", target_replicas=2,
                       kv_cache_tokens=2048, worker_threads=1, log_dir=tmp_path / "logs", discovery="given")
    cluster = LocalCluster(spec)
    with KubeApiStub() as api:
        try:
            cluster.start_workers()
            first, second = cluster.workers("target")
            api.apply(NS, worker_slice("first", first.port))
            api.apply(NS, endpoint_slice("drafts-a", "drafts", [endpoint("127.0.0.1")], second.port))  # not ours
            kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
            coordinator = cluster.add_coordinator(extra_args=(
                "--discovery", "kubernetes", "--target-service", "targets", "--namespace", NS,
                "--kubeconfig", str(kubeconfig)))
            with Traffic(coordinator.address, PROMPTS) as traffic:
                assert {r.stats.target_worker for r in traffic.take_references()} == {first.address}
                traffic.start()

                with TandemClient(coordinator.address, timeout_s=60) as client:
                    api.apply(NS, worker_slice("second", second.port))  # scaled up
                    assert until(lambda: states(client).get(second.address) == "healthy", 60)
                    assert until_used(traffic, second.address), "the added replica never got a request"

                    # Scaled down: the pod turns terminating (not ready), then its slice goes.
                    api.apply(NS, worker_slice("first", first.port, ready=False, terminating=True))
                    assert until(lambda: states(client).get(first.address) != "healthy", 60)
                    marked = len(traffic.replies)
                    api.delete(NS, "targets-first")
                    assert until(lambda: first.address not in states(client), 120)  # drained, then closed
                    assert until(lambda: len(traffic.replies) >= marked + 4, 120)
            assert not traffic.errors, traffic.errors[:3]
            assert len(traffic.replies) > marked + 3
            assert not traffic.wrong_replies()
            # The one request that may have been running on it when it was marked finished there; none after.
            assert traffic.workers(marked + 1) == {second.address}
        finally:
            cluster.stop()
