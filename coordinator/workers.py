"""Clients of the draft and target workers, and the pools that route requests to them.

Every call carries a deadline; gRPC failures come back as domain errors
(``tandem.rpc.status.domain_error``) naming the worker. A pool polls each
replica's Info in the background and picks, for a new request, the healthy
replica with the most free KV blocks and the shortest queue, counting the
requests it has itself placed since the last poll so that a burst spreads out.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import grpc

from tandem.errors import WorkerUnavailableError
from tandem.rpc.server import GRPC_OPTIONS
from tandem.rpc.status import domain_error
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

INFO_TIMEOUT_S = 2.0


class WorkerClient:
    """One worker replica: a channel, its stub, and its last known capacity."""

    def __init__(self, address: str, role: str, call_timeout_s: float) -> None:
        self.address = address
        self.role = role
        self.call_timeout_s = call_timeout_s
        self.channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        stub_class = draft_pb2_grpc.DraftWorkerStub if role == "draft" else target_pb2_grpc.TargetWorkerStub
        self.stub: Any = stub_class(self.channel)
        self.info: common_pb2.WorkerInfo | None = None
        self.healthy = False
        self.placed_since_poll = 0
        self.active = 0  # this coordinator's requests placed here and not yet finished

    async def call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        try:
            return await getattr(self.stub, method)(request, timeout=timeout or self.call_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self.healthy = False
            raise domain_error(exc, f"{self.role} worker {self.address}") from None

    async def refresh(self) -> None:
        try:
            self.info = await self.stub.Info(common_pb2.WorkerInfoRequest(), timeout=INFO_TIMEOUT_S)
            self.healthy = True
        except grpc.aio.AioRpcError:
            self.healthy = False
        self.placed_since_poll = 0

    @property
    def streams(self) -> int:
        """Sequences sharing this worker now: ours, or all of them as its last Info said."""
        return max(self.active, self.info.active_sequences if self.info else 0)

    def score(self) -> tuple[float, float]:
        """Higher is better: free KV (minus what we just placed), then a short queue."""
        if self.info is None:
            return (0.0, 0.0)
        share = self.info.total_blocks / max(1, self.info.active_sequences + 8)
        return (self.info.free_blocks - self.placed_since_poll * share, -self.info.queue_depth)

    # ----- typed calls -----------------------------------------------------
    async def prefill(self, seq_id: str, token_ids: list[int], sampling: common_pb2.SamplingOptions) -> int:
        reply = await self.call("Prefill", target_pb2.PrefillRequest(seq_id=seq_id, token_ids=token_ids,
                                                                     sampling=sampling))
        return reply.next_token

    async def verify(self, seq_id: str, committed_len: int, drafts: list[int],
                     probs: list[common_pb2.SparseDistribution]) -> target_pb2.VerifyResponse:
        return await self.call("Verify", target_pb2.VerifyRequest(
            seq_id=seq_id, committed_len=committed_len, draft_tokens=drafts, draft_probs=probs))

    async def propose(self, seq_id: str, committed_len: int, new_tokens: list[int], k: int,
                      sampling: common_pb2.SamplingOptions) -> draft_pb2.ProposeResponse:
        return await self.call("Propose", draft_pb2.ProposeRequest(
            seq_id=seq_id, committed_len=committed_len, new_tokens=new_tokens, k=k, sampling=sampling))

    async def release(self, seq_id: str) -> None:
        """Best effort: a worker that is gone has freed the KV anyway."""
        try:
            await self.call("Release", common_pb2.ReleaseRequest(seq_id=seq_id), timeout=5.0)
        except Exception as exc:  # noqa: BLE001
            log.warning("release of %s on %s failed: %s", seq_id, self.address, exc)

    async def close(self) -> None:
        await self.channel.close()


@dataclass(slots=True)
class WorkerPool:
    role: str
    clients: list[WorkerClient]

    @classmethod
    def from_addresses(cls, role: str, addresses: list[str], call_timeout_s: float) -> WorkerPool:
        return cls(role, [WorkerClient(a, role, call_timeout_s) for a in addresses])

    def pick(self) -> WorkerClient:
        healthy = [c for c in self.clients if c.healthy] or self.clients
        if not healthy:
            raise WorkerUnavailableError(f"no {self.role} workers configured")
        best = max(healthy, key=lambda c: c.score())
        best.placed_since_poll += 1
        return best

    async def refresh_all(self) -> None:
        await asyncio.gather(*(c.refresh() for c in self.clients))

    async def poll_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.refresh_all()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))
