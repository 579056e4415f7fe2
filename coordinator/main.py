"""Entry point of the coordinator process (`tandem serve coordinator`)."""

from __future__ import annotations

import asyncio
import logging

from coordinator.access import AccessControl
from coordinator.service import GenerationService
from coordinator.workers import WorkerPool
from tandem.config import CoordinatorConfig
from tandem.errors import InvalidRequestError, WorkerUnavailableError
from tandem.rpc.metrics import CoordinatorMetrics
from tandem.rpc.server import ManagedServer, serve_until_signalled
from tandem.spec.shared_cache import SharedContinuations
from tandem.tokenizer import load_tokenizer, tokenizer_fingerprint
from tandem.v1 import generation_pb2_grpc

log = logging.getLogger(__name__)

WORKER_WAIT_S = 600.0  # workers may still be loading weights when the coordinator starts


async def wait_for_workers(pool: WorkerPool, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        await pool.refresh_all()
        if all(c.healthy for c in pool.clients):
            return
        if asyncio.get_running_loop().time() > deadline:
            down = [c.address for c in pool.clients if not c.healthy]
            raise WorkerUnavailableError(f"{pool.role} workers not answering: {', '.join(down)}")
        await asyncio.sleep(0.5)


async def serve(cfg: CoordinatorConfig) -> None:
    tokenizer = load_tokenizer(cfg.tokenizer_dir)
    fingerprint = tokenizer_fingerprint(tokenizer)
    targets = WorkerPool.from_addresses("target", cfg.target_addrs, cfg.call_timeout_s, cfg.worker_tls)
    drafts = WorkerPool.from_addresses("draft", cfg.draft_addrs, cfg.call_timeout_s, cfg.worker_tls)
    access = AccessControl(cfg.auth, cfg.max_concurrent_per_client)
    server = ManagedServer("coordinator", cfg.server, interceptors=[access], max_receive_bytes=cfg.max_request_bytes)
    # One cache per tokenizer: the fingerprint namespaces it, so that different models never mix.
    cache = SharedContinuations(fingerprint, cfg.redis_url) if cfg.continuation_cache else None
    metrics = CoordinatorMetrics(server.registry, cache.snapshot if cache else None)
    service = GenerationService(cfg, tokenizer, targets, drafts, server, metrics, cache)
    server.add_service(generation_pb2_grpc.add_GenerationServicer_to_server, service, "tandem.v1.Generation")
    pollers: list[asyncio.Task] = []

    async def warmup() -> None:
        await asyncio.gather(wait_for_workers(targets, WORKER_WAIT_S), wait_for_workers(drafts, WORKER_WAIT_S))
        for client in [*targets.clients, *drafts.clients]:
            if client.info.tokenizer_fingerprint != fingerprint:
                raise InvalidRequestError(
                    f"{client.role} worker {client.address} uses another tokenizer than {cfg.tokenizer_dir}")
        info = targets.clients[0].info
        service.vocab_size, service.max_context = info.vocab_size, info.max_context
        if cache is not None:
            cache.vocab_size = info.vocab_size  # shared entries outside the vocabulary are never proposed
            await cache.start()
        service.model_stop_ids = frozenset(info.stop_token_ids)
        pollers.extend(asyncio.create_task(p.poll_forever(cfg.info_poll_s)) for p in (targets, drafts))
        log.info("coordinator: %d target and %d draft workers ready", len(targets.clients), len(drafts.clients))

    try:
        await serve_until_signalled(server, warmup)
    finally:
        for task in pollers:
            task.cancel()
        if cache is not None:
            await cache.close()
        await targets.close()
        await drafts.close()
