"""What the fault, soak and KV tests share: a cluster of SmolLM2 replicas, and a look inside it."""

from __future__ import annotations

from pathlib import Path

import grpc

from tandem.cluster import ClusterSpec, LocalCluster, Service
from tandem.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc


def smollm2_cluster(model_dir: Path, log_dir: Path, *, targets: int = 2, drafts: int = 1,
                    kv_cache_tokens: int = 4096, coordinator_args: tuple[str, ...] = (),
                    call_timeout_s: float = 15.0) -> LocalCluster:
    """bf16 SmolLM2 target and draft replicas (one torch thread each: they share two cores), and a
    coordinator that takes a worker silent for 15 s for hung (long enough for a busy machine)."""
    return LocalCluster(ClusterSpec(
        target=str(model_dir), draft=str(model_dir) if drafts else None, dtype="bfloat16",
        target_replicas=targets, draft_replicas=drafts, kv_cache_tokens=kv_cache_tokens, worker_threads=1,
        log_dir=log_dir,
        coordinator_args=("--call-timeout", str(call_timeout_s), "--move-wait", "30", *coordinator_args)))


def worker_info(service: Service) -> common_pb2.WorkerInfo:
    with grpc.insecure_channel(service.address) as channel:
        stub_class = target_pb2_grpc.TargetWorkerStub if service.role == "target" else draft_pb2_grpc.DraftWorkerStub
        return stub_class(channel).Info(common_pb2.WorkerInfoRequest(), timeout=10)


def serving(cluster: LocalCluster, role: str) -> Service:
    """The replica of ``role`` that holds a sequence now (the tests run one request at a time)."""
    holding = [s for s in cluster.workers(role) if s.process.poll() is None and worker_info(s).active_sequences]
    assert len(holding) == 1, f"expected one {role} replica holding the request, found {len(holding)}"
    return holding[0]
