"""Worker discovery: where the replicas of each role are, over time.

A source yields the complete set of routable addresses of one role each time
it changes; ``follow`` hands every set to a ``WorkerPool``, which adds the new
replicas and lets the ones that left drain (``coordinator.workers``). Four
sources, picked by ``--discovery``:

- ``static``: the ``--target-addr`` / ``--draft-addr`` lists, once;
- ``file``: a JSON workers file, re-read when it changes (``tandem up``);
- ``dns``: the A/AAAA records of a headless Service, re-resolved every few seconds;
- ``kubernetes``: a list+watch of the Service's EndpointSlices.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from tandem.config import CoordinatorConfig

if TYPE_CHECKING:
    from coordinator.workers import WorkerPool

log = logging.getLogger(__name__)

RESTART_DELAY_S = 5.0  # a source that failed unexpectedly is restarted after this long
DEFAULT_PORTS = {"target": 50052, "draft": 50053}  # `tandem serve target|draft` listen here by default


class WorkerSource(Protocol):
    """The routable addresses (``HOST:PORT``) of one role: yielded at start and after every change."""

    role: str

    def watch(self) -> AsyncIterator[frozenset[str]]: ...


def make_source(cfg: CoordinatorConfig, role: str) -> WorkerSource | None:
    """The source of ``role``'s replicas under ``cfg``; None when the role has none (no drafts configured)."""
    if cfg.discovery == "static":
        from coordinator.discovery.static import StaticSource

        addrs = cfg.target_addrs if role == "target" else cfg.draft_addrs
        return StaticSource(role, addrs) if addrs else None
    if cfg.discovery == "file":
        from coordinator.discovery.workers_file import WorkersFileSource

        return WorkersFileSource(role, cfg.workers_file)
    service = cfg.target_service if role == "target" else cfg.draft_service
    if not service:
        return None
    port = cfg.target_port if role == "target" else cfg.draft_port
    if cfg.discovery == "dns":
        from coordinator.discovery.dns import DnsSource

        return DnsSource(role, service, port or DEFAULT_PORTS[role], cfg.dns_interval_s)
    from coordinator.discovery.endpointslices import EndpointSliceSource

    return EndpointSliceSource(role, service, cfg.namespace, port, cfg.kubeconfig)


async def follow(source: WorkerSource, pool: WorkerPool) -> None:
    """Apply every set the source yields to the pool, for as long as the coordinator runs."""
    while True:
        try:
            async for addresses in source.watch():
                pool.update(addresses)
            return  # a finite source (static) has said all it will say
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - discovery must outlive its own bugs; the pool keeps its replicas
            log.exception("%s discovery failed; restarting it in %.0fs", source.role, RESTART_DELAY_S)
            await asyncio.sleep(RESTART_DELAY_S)
