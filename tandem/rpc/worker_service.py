"""What the draft and target servicers share: their wiring, Release and Info.

A coordinator's periodic Info names it (``owner``) and is its heartbeat: it renews that coordinator's
lease (``tandem.rpc.leases``) as it arrives; its computing calls renew it when their batch runs
(``tandem.rpc.sequence_engine``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from tandem.block_pool import PrefixCacheStats
from tandem.device_key import device_key
from tandem.rpc.batcher import Batcher
from tandem.rpc.calls import ReleaseCall
from tandem.rpc.server import ManagedServer
from tandem.v1 import common_pb2


class WorkerServiceBase:
    """Holds a role engine (``.engine``, ``.num_sequences``, ``.leases``; ``run_batch`` takes ``ReleaseCall``)
    and its batcher."""

    role = "worker"

    def __init__(self, engine: Any, batcher: Batcher, server: ManagedServer, model_name: str,
                 tokenizer_fingerprint: str, stop_token_ids: list[int]) -> None:
        self.engine = engine
        self.batcher = batcher
        self.server = server
        self.model_name = model_name
        self.fingerprint = tokenizer_fingerprint
        self.stop_token_ids = stop_token_ids
        self._device_key: str | None = None  # (at the first Info: the engine is loaded by then)

    async def Release(self, request: common_pb2.ReleaseRequest, context: grpc.aio.ServicerContext):
        # Shielded: a caller that gives up (its deadline passed while the release queued behind forward
        # passes) cancels this handler, and the batcher drops cancelled calls; the sequence's KV would then
        # be held for good (found by the fuzz test under load). The release runs to its end regardless.
        held = await asyncio.shield(self._release(request.seq_id))
        return common_pb2.ReleaseResponse(released=held)

    async def _release(self, seq_id: str) -> bool:
        # Through the batcher, so the KV pool changes only on the model thread. Taken while draining too:
        # a release only frees.
        held: bool = await self.batcher.submit(ReleaseCall(seq_id))
        self.batcher.forget(seq_id)  # after the release's own batch, which counted it as cycling
        return held

    async def Info(self, request: common_pb2.WorkerInfoRequest, context: grpc.aio.ServicerContext):
        self.engine.leases.renew(request.owner)
        if request.owner and request.sent_at:
            self.engine.room_waits.clocks.heard(request.owner, request.sent_at)
        model = self.engine.engine
        cache = model.kv_cache
        waits, scored = self.engine.shared_prompt_stats()
        return common_pb2.WorkerInfo(
            role=self.role, model=self.model_name, vocab_size=model.config.vocab_size,
            max_context=model.config.max_position_embeddings, total_blocks=cache.num_blocks,
            free_blocks=cache.num_free_blocks, block_size=cache.block_size, queue_depth=self.batcher.queue_depth,
            active_sequences=self.engine.num_sequences, tokenizer_fingerprint=self.fingerprint,
            stop_token_ids=self.stop_token_ids, forward_base_s=model.cost_fit.base_s,
            forward_per_token_s=model.cost_fit.per_token_s, last_forward_base_s=model.cost_fit.last_base_s,
            last_forward_per_token_s=model.cost_fit.last_per_token_s,
            prompt_token_s=model.prompt_cost.per_token_s, lease_s=self.engine.leases.lease_s,
            heads=self.engine.heads_kind,
            prefix_cache=_prefix_cache_info(cache.prefix_stats(), self.engine.caches_generated),
            heads_prefix_cache=(None if (heads := self.engine.heads_prefix_stats()) is None
                                else _prefix_cache_info(heads, self.engine.caches_generated)),
            shared_prompt_waits=waits, prompt_score_blocks=scored, step_running_s=self.batcher.step_running_s,
            step_tokens=max(self.batcher.step_tokens, model.rows_in_forward),
            device_key=self.device_key(), calls_per_batch=self.batcher.calls_per_batch,
        )

    def device_key(self) -> str:
        """What the model computes on (``tandem.device_key``; a tensor-parallel target's: its rank 0's GPU)."""
        if self._device_key is None:
            self._device_key = device_key(self.engine.engine.device)
        return self._device_key


def _prefix_cache_info(stats: PrefixCacheStats, generated: bool) -> common_pb2.PrefixCacheInfo:
    return common_pb2.PrefixCacheInfo(
        enabled=stats.enabled, prompt_tokens=stats.prompt_tokens, reused_tokens=stats.reused_tokens,
        cached_blocks=stats.cached_blocks, evictable_blocks=stats.evictable_blocks, evictions=stats.evictions,
        generated=stats.enabled and generated)
