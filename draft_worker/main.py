"""Entry point of a draft worker process (`tandem serve draft`)."""

from __future__ import annotations

from draft_worker.engine import DraftEngine
from draft_worker.service import DraftService
from tandem.config import WorkerConfig
from tandem.rpc.worker_runner import WorkerRole, run_worker
from tandem.v1 import draft_pb2_grpc

DRAFT_ROLE = WorkerRole(
    name="draft",
    make_engine=lambda engine, leases, cfg: DraftEngine(engine, leases, cfg.prefill_chunk_tokens,
                                                     cache_generated=cfg.cache_generated, reserve_growth=True),
    make_service=DraftService,
    add_to_server=draft_pb2_grpc.add_DraftWorkerServicer_to_server,
    service_full_name="tandem.v1.DraftWorker",
    gather_fraction=8.0,
)


async def serve(cfg: WorkerConfig) -> None:
    await run_worker(DRAFT_ROLE, cfg)
