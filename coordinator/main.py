"""Entry point of the coordinator process (`tandem serve coordinator`)."""

from __future__ import annotations

import asyncio
import logging

from coordinator.access import AccessControl
from coordinator.discovery import follow, make_source
from coordinator.http import HttpApi
from coordinator.service import GenerationService
from coordinator.stats_log import StatsLog
from coordinator.workers import RELEASE_TIMEOUT_S, WorkerPool, new_owner_id
from tandem.config import CoordinatorConfig
from tandem.errors import WorkerUnavailableError
from tandem.rpc.metrics import CoordinatorMetrics
from tandem.rpc.server import ManagedServer, serve_until_signalled
from tandem.spec.adaptive import MatchRates
from tandem.spec.shared_cache import SharedContinuations
from tandem.tokenizer import load_tokenizer, tokenizer_fingerprint
from tandem.v1 import generation_pb2_grpc

log = logging.getLogger(__name__)

# With a static list, workers may still be loading weights when the coordinator starts: wait this long for
# one target, then give up with an error. Discovered fleets may be empty for a while (scaled to zero, still
# scheduling): the coordinator waits for them as long as it takes.
STATIC_WORKER_WAIT_S = 600.0
WAIT_POLL_S = 0.5
WAIT_REPORT_S = 15.0  # while no target is usable, the log says every this often what each listed one answers


async def wait_for_target(pool: WorkerPool, timeout_s: float | None) -> None:
    """Until one target replica has answered Info with our tokenizer."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = None if timeout_s is None else start + timeout_s
    next_report = start + WAIT_REPORT_S
    while True:
        await pool.refresh_all()
        if pool.has_healthy():
            return
        now = loop.time()
        if deadline is not None and now > deadline:
            raise WorkerUnavailableError(f"no usable {pool.role} worker after {timeout_s:.0f}s ({pool.describe()})")
        if now >= next_report:
            limit = "" if timeout_s is None else f" (giving up after {timeout_s:.0f}s)"
            log.warning("no usable %s worker yet after %.0fs%s: %s", pool.role, now - start, limit, pool.describe())
            next_report = now + WAIT_REPORT_S
        await asyncio.sleep(WAIT_POLL_S)


async def serve(cfg: CoordinatorConfig) -> None:
    tokenizer = load_tokenizer(cfg.tokenizer_dir)
    if cfg.chat_template is not None:
        tokenizer.chat_template = cfg.chat_template_text()
    fingerprint = tokenizer_fingerprint(tokenizer)
    # Replicas are found by discovery (coordinator/discovery): each one joins when its Info shows our tokenizer.
    owner = new_owner_id()  # one instance id for this coordinator: its lease on every worker it calls
    targets = WorkerPool("target", [], fingerprint, cfg.call_timeout_s, cfg.worker_tls, owner)
    drafts = WorkerPool("draft", [], fingerprint, cfg.call_timeout_s, cfg.worker_tls, owner)
    access = AccessControl(cfg.auth, cfg.max_concurrent_per_client)
    server = ManagedServer("coordinator", cfg.server, interceptors=[access], max_receive_bytes=cfg.max_request_bytes)
    # One cache per tokenizer: the fingerprint namespaces it, so that different models never mix.
    cache = SharedContinuations(fingerprint, cfg.redis_url) if cfg.continuation_cache else None
    match_rates = MatchRates()  # acceptance per kind of n-gram match, learned over this coordinator's requests
    metrics = CoordinatorMetrics(server.registry, cache.snapshot if cache else None,
                                 replica_counts=lambda: {"target": targets.counts(), "draft": drafts.counts()},
                                 match_rates=match_rates.snapshot,
                                 busy_waits=lambda: {"target": targets.busy_waits(), "draft": drafts.busy_waits()},
                                 # (the service's name for the model, --served-model-name or the workers': made next)
                                 served_model=lambda: service.target_model(), kv_usage=targets.kv_usage)
    service = GenerationService(cfg, tokenizer, targets, drafts, server, metrics, cache, match_rates)
    server.add_service(generation_pb2_grpc.add_GenerationServicer_to_server, service, "tandem.v1.Generation")
    server.drain_work = service.drain  # on SIGTERM: both APIs' requests finish, or end saying why, within the grace
    # The OpenAI-compatible API on this event loop, into the same service; bound now so that the READY line names
    # its port, answering 503 until the warm-up is done.
    http = HttpApi(service, access, cfg, tokenizer, server.registry) if cfg.http_port is not None else None
    if http is not None:
        server.more_ports["http_port"] = await http.start()
    background: list[asyncio.Task] = []

    async def warmup() -> None:
        for pool in (targets, drafts):
            source = make_source(cfg, pool.role)
            if source is not None:
                background.append(asyncio.create_task(follow(source, pool)))
            background.append(asyncio.create_task(pool.poll_forever(cfg.info_poll_s)))
        # SERVING once one target answers; requests use n-gram or plain decoding until a draft does.
        await wait_for_target(targets, STATIC_WORKER_WAIT_S if cfg.discovery == "static" else None)
        await drafts.refresh_all()  # every draft replica known by now has had its say before the first request
        info = next(c.info for c in targets.clients if c.routable and c.healthy)
        service.vocab_size, service.max_context = info.vocab_size, info.max_context
        if cache is not None:
            cache.vocab_size = info.vocab_size  # shared entries outside the vocabulary are never proposed
            await cache.start()
        service.model_stop_ids = frozenset(info.stop_token_ids)
        log.info("coordinator: serving with targets %s and drafts %s (discovery: %s)",
                 targets.counts(), drafts.counts(), cfg.discovery)
        if cfg.log_stats_interval_s:
            stats = StatsLog(metrics, targets.kv_usage, cfg.log_stats_interval_s)
            background.append(asyncio.create_task(stats.run()))

    try:
        await serve_until_signalled(server, warmup)
    finally:
        if http is not None:  # draining: it refuses new requests (503) and lets those in flight finish
            await http.stop()
        for task in background:
            task.cancel()
        await service.finish_releases(RELEASE_TIMEOUT_S)  # the last requests' KV, freed before the channels close
        if cache is not None:
            await cache.close()
        await targets.close()
        await drafts.close()
