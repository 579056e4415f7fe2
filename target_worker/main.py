"""Entry point of a target worker process (`tandem serve target`)."""

from __future__ import annotations

from tandem.config import WorkerConfig
from tandem.engine import ModelEngine
from tandem.rpc.leases import Leases
from tandem.rpc.worker_runner import WorkerRole, run_worker
from tandem.structured_output import StructuredOutput
from tandem.v1 import target_pb2_grpc
from target_worker.engine import TargetEngine
from target_worker.service import TargetService


def make_target_engine(engine: ModelEngine, leases: Leases, cfg: WorkerConfig) -> TargetEngine:
    """The target's engine, with its speculation heads when the worker was given some (``--heads``), and its
    tokenizer's view for structured output."""
    drafter = None
    if cfg.heads is not None:
        from tandem.heads.serving import load_drafter  # checks the heads belong to this target

        drafter = load_drafter(cfg.heads, engine)
    return TargetEngine(engine, leases, drafter, prefill_chunk_tokens=cfg.prefill_chunk_tokens,
                        structured=StructuredOutput(cfg.engine.model_dir, engine.config),
                        cache_generated=cfg.cache_generated, share_prompts=cfg.shared_prompt_wait,
                        reserve_growth=True)  # (coordinators start requests without reserving their room)


TARGET_ROLE = WorkerRole(
    name="target",
    make_engine=make_target_engine,
    make_service=TargetService,
    add_to_server=target_pb2_grpc.add_TargetWorkerServicer_to_server,
    service_full_name="tandem.v1.TargetWorker",
    gather_fraction=1.0,
)


async def serve(cfg: WorkerConfig) -> None:
    await run_worker(TARGET_ROLE, cfg)
