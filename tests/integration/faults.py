"""What the fault, soak and KV tests share: a cluster of real worker processes, and a look inside it."""

from __future__ import annotations

import time
from pathlib import Path

import grpc

from tandem.cluster import ClusterSpec, LocalCluster, Service
from tandem.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

# How long the coordinator waits on a worker's call before it takes the worker for hung. The tiny
# served model answers every call in milliseconds, so a few seconds are far beyond a busy machine's
# delay and a hung worker is found quickly; a real model's calls need longer.
TINY_CALL_TIMEOUT_S = 5.0


def local_cluster(model_dir: Path, log_dir: Path, *, targets: int = 2, drafts: int = 1,
                  kv_cache_tokens: int = 4096, coordinator_args: tuple[str, ...] = (),
                  call_timeout_s: float = TINY_CALL_TIMEOUT_S) -> LocalCluster:
    """bf16 target and draft replicas of ``model_dir`` (one torch thread each: they share two cores), and a
    coordinator that takes a worker silent for ``call_timeout_s`` for hung."""
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


def assert_kv_whole(workers: list[Service], wait_s: float = 10.0) -> None:
    """Each worker's KV pool is back to its baseline: every block free, no sequence held, within ``wait_s`` (an ended
    request's release runs after its reply: coordinator/service.py)."""
    deadline = time.monotonic() + wait_s
    for worker in workers:
        while True:
            info = worker_info(worker)
            if (info.free_blocks == info.total_blocks and info.active_sequences == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert info.free_blocks == info.total_blocks and info.active_sequences == 0, worker.role
