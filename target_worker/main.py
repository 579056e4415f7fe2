"""Entry point of a target worker process (`tandem serve target`)."""

from __future__ import annotations

from tandem.config import WorkerConfig
from tandem.rpc.worker_runner import WorkerRole, run_worker
from tandem.v1 import target_pb2_grpc
from target_worker.engine import TargetEngine
from target_worker.service import TargetService

TARGET_ROLE = WorkerRole(
    name="target",
    make_engine=TargetEngine,
    make_service=TargetService,
    add_to_server=target_pb2_grpc.add_TargetWorkerServicer_to_server,
    service_full_name="tandem.v1.TargetWorker",
    gather_fraction=1.0,
)


async def serve(cfg: WorkerConfig) -> None:
    await run_worker(TARGET_ROLE, cfg)
