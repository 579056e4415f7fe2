"""What both worker roles do to come up: load, wire the batcher and service, warm up, serve; and,
while serving, take back the sequences whose coordinator went silent (``tandem.rpc.leases``)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tandem.config import WorkerConfig
from tandem.engine import ModelEngine
from tandem.parallel.engine import TensorParallelEngine, load_engine
from tandem.rpc.batcher import Batcher
from tandem.rpc.leases import Leases
from tandem.rpc.metrics import PrefixCacheCollector, SharedPromptCollector, WorkerMetrics
from tandem.rpc.room_waits import room_hold_s
from tandem.rpc.server import ManagedServer, serve_until_signalled
from tandem.rpc.startup_lock import StartupLock
from tandem.tokenizer import load_tokenizer, stop_token_ids, tokenizer_fingerprint

log = logging.getLogger(__name__)


class RoleEngine(Protocol):
    engine: ModelEngine
    leases: Leases

    def run_batch(self, calls: list[Any]) -> list[Any]: ...
    def call_cost(self, call: Any) -> int: ...
    def warmup(self) -> None: ...
    def reclaim(self) -> list[Any]: ...


@dataclass(slots=True)
class WorkerRole:
    """How one role differs: its engine, its servicer and its gRPC service."""

    name: str  # "draft" or "target"
    make_engine: Callable[..., RoleEngine]  # (engine, leases, worker config)
    make_service: Callable[..., Any]  # (engine, batcher, server, model_name, fingerprint, stop_ids)
    add_to_server: Callable[[Any, Any], None]
    service_full_name: str
    # Longest wait for a batch to fill, in this role's forward passes: a draft waits out a target's
    # verify (several of its own steps), a target waits out k draft steps (less than one of its own).
    gather_fraction: float


def exit_on_stop_signals_until_serving(role: str) -> None:
    """Until the server takes SIGTERM and SIGINT over (``serve_until_signalled``: drain, then stop), either ends
    the process at once: nothing is in flight yet, and waiting for the startup lock, loading and warming up can
    take minutes. Left at its default action, a container's PID 1 never sees the signal (the kernel ignores
    it there): a pod deleted while its worker loaded waited out its whole grace period, then was killed."""
    def stop(signum: int, frame: object) -> None:
        log.info("%s: stopped by %s while starting", role, signal.Signals(signum).name)
        logging.shutdown()  # (flushes: os._exit would not)
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


async def run_worker(role: WorkerRole, cfg: WorkerConfig) -> None:
    exit_on_stop_signals_until_serving(role.name)
    # The one thread that loads, warms up and runs the model: a second thread computing beside the
    # loader would give the process two OpenMP teams and slow every forward (tandem.compute_thread).
    model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
    # Held while loading, packing and warming up: workers on the same cores calibrate one at a time.
    startup = StartupLock(cfg.startup_lock, role.name)
    try:
        await startup.acquire()
        await _run_worker(role, cfg, model_thread, startup)
    finally:
        startup.release()
        model_thread.shutdown(wait=False, cancel_futures=True)


async def _run_worker(role: WorkerRole, cfg: WorkerConfig, model_thread: ThreadPoolExecutor,
                      startup: StartupLock) -> None:
    log.info("%s: loading %s", role.name, cfg.engine.model_dir)
    engine = await asyncio.get_running_loop().run_in_executor(model_thread, load_engine, cfg.engine)
    failed = asyncio.Event()  # a tensor-parallel rank died or hung: stop serving, exit non-zero
    if isinstance(engine, TensorParallelEngine):
        loop = asyncio.get_running_loop()
        engine.ranks.on_failure = lambda reason: loop.call_soon_threadsafe(failed.set)
    tokenizer = load_tokenizer(cfg.engine.model_dir)
    role_engine = await asyncio.get_running_loop().run_in_executor(  # heads are packed and timed: model thread
        model_thread, role.make_engine, engine, Leases(cfg.lease_s, cfg.idle_ttl_s), cfg)
    server = ManagedServer(role.name, cfg.server, traced_calls=True)
    metrics = WorkerMetrics(server.registry, role.name)
    metrics.kv_blocks_total.set(engine.kv_cache.num_blocks)
    server.registry.register(PrefixCacheCollector(role.name, engine.kv_cache.prefix_stats))
    if role_engine.heads_prefix_stats() is not None:  # an EAGLE head's own cache: tandem_target_heads_prefix_cache_*
        server.registry.register(PrefixCacheCollector(f"{role.name}_heads", role_engine.heads_prefix_stats))
    if role.name == "target":
        server.registry.register(SharedPromptCollector(role_engine.shared_prompt_stats))

    def kv_gauges() -> None:
        metrics.kv_blocks_used.set(engine.kv_cache.num_blocks - engine.kv_cache.num_free_blocks)
        metrics.active_sequences.set(len(engine.kv_cache.sequences()))

    def on_batch(num_calls: int, num_tokens: int, seconds: float) -> None:
        metrics.batch_seconds.observe(seconds)
        metrics.batch_size.observe(num_calls)
        metrics.batch_tokens.observe(num_tokens)
        kv_gauges()

    gather_fraction = role.gather_fraction if cfg.gather_fraction is None else cfg.gather_fraction
    batcher = Batcher(
        role_engine.run_batch, role_engine.call_cost, cfg.token_budget, on_batch,
        key=lambda call: call.seq_id,
        gather_wait_s=lambda: gather_fraction * engine.cost_fit.base_s, executor=model_thread,
        hold_s=room_hold_s,  # a Prefill refused for room waits here for it when it asked to (wait_for_room_s)
    )
    # Draining, it takes no new sequence: a Prefill held for room is refused at once, and its coordinator asks a
    # replica that stays (the drain waits for calls in flight, and a held one would take a sequence it must give up).
    server.on_drain.append(batcher.refuse_held)
    metrics.queue_depth.set_function(lambda: batcher.queue_depth)  # (as it is when scraped, batch running or not)
    metrics.held_for_room.set_function(lambda: batcher.held)
    service = role.make_service(
        role_engine, batcher, server, cfg.model_name, tokenizer_fingerprint(tokenizer),
        sorted(stop_token_ids(cfg.engine.model_dir, tokenizer, engine.config)),
    )
    server.add_service(role.add_to_server, service, role.service_full_name)
    background: list[asyncio.Task] = []

    async def reclaim_forever() -> None:
        """Every sweep interval, on the model thread: free what expired leases and idle sequences hold."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(role_engine.leases.sweep_interval_s)
            try:
                expired = await loop.run_in_executor(batcher.executor, role_engine.reclaim)
            except Exception:  # noqa: BLE001 - the sweep must outlive one failure; the next one retries
                log.exception("%s: freeing expired sequences failed", role.name)
                continue
            for item in expired:
                batcher.forget(item.seq_id)
                metrics.sequences_reclaimed.labels(item.reason).inc()
            if expired:
                kv_gauges()
                owners = sorted({f"{item.owner or 'no owner'} ({item.reason})" for item in expired})
                log.warning("%s: freed %d sequences whose coordinator went silent or that sat idle: %s",
                            role.name, len(expired), ", ".join(owners))

    async def warmup() -> None:
        # On the model thread, like every later change to the engine's state.
        await asyncio.get_running_loop().run_in_executor(batcher.executor, role_engine.warmup)
        startup.release()  # calibrated: the next co-located worker may come up
        engine.kv_cache.pool.reset_stats()  # the hit rate counts requests, not the warm-up's own prompts
        batcher.start()
        background.append(asyncio.create_task(reclaim_forever()))
        log.info("%s: warmed up (%d threads); sequence lease %.0fs, idle time-to-live %.0fs", role.name,
                 torch.get_num_threads(), cfg.lease_s, cfg.idle_ttl_s)

    healthy = await serve_until_signalled(server, warmup, failed)
    for task in background:
        task.cancel()
    if not healthy and isinstance(engine, TensorParallelEngine):
        engine.ranks.exit_now()  # the model thread may be blocked in a collective with the dead rank
    await asyncio.get_running_loop().run_in_executor(batcher.executor, engine.close)
    await batcher.stop()
