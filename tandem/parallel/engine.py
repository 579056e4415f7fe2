"""Rank 0's engine: a ``ModelEngine`` over its shard that announces every forward pass to the other ranks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

from tandem.config import EngineConfig, ModelConfig
from tandem.engine import FeatureRequest, ForwardBatch, ModelEngine
from tandem.errors import WorkerUnavailableError
from tandem.models import load_model
from tandem.models.packed import pack_linear_weights
from tandem.models.row_padding import PaddingTuner
from tandem.models.tensor_parallel import ParallelModel, check_splittable
from tandem.parallel import step
from tandem.parallel.ranks import RankGroup

T = TypeVar("T")


class TensorParallelEngine(ModelEngine):
    """Scheduling and KV bookkeeping as in one process; each forward is broadcast, then run on every rank."""

    ranks: RankGroup
    parallel: ParallelModel

    @classmethod
    def load(cls, cfg: EngineConfig) -> TensorParallelEngine:
        model_cfg = ModelConfig.from_dir(cfg.model_dir)
        check_splittable(model_cfg, cfg.tensor_parallel_size)  # before any process is started
        ranks = RankGroup.start(cfg)
        try:
            context = ranks.context
            parallel = ParallelModel(context.shard, context.compute)
            model = load_model(cfg.model_dir, model_cfg, cfg.resolved_dtype, context.device, parallel)
            if cfg.pack_weights:  # each rank packs its own shard
                pack_linear_weights(model, PaddingTuner())
            engine = cls.with_new_cache(model, cfg.num_blocks, cfg.block_size, cfg.attention_backend,
                                        prefix_caching=cfg.prefix_caching, salt=cfg.cache_salt)
            engine.ranks, engine.parallel = ranks, parallel
            torch.distributed.barrier(group=context.control)  # every rank has loaded its shard
        except BaseException:
            ranks.abort()
            raise
        return engine

    def compute(
        self, batch: ForwardBatch, features: FeatureRequest | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # -> [R, vocab] float32, [F, feature] or None
        """Every rank runs the batch; features are rank 0's own (every rank holds the whole hidden state)."""
        context, clock = self.ranks.context, self.parallel.clock

        def announce() -> None:
            started = time.perf_counter()
            step.send_forward(batch, context.control, context.device, context.timeout)
            if clock.enabled:
                clock.broadcast_seconds += time.perf_counter() - started

        compute_here = super().compute
        return self._on_every_rank("a forward pass", announce, lambda: compute_here(batch, features))

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every rank holds K/V of its own heads: each copies the same slots (``keep_path``)."""
        context, move_here = self.ranks.context, super().move_kv
        self._on_every_rank(
            "a KV move",
            lambda: step.send_move(step.KVMove(src, dst), context.control, context.device, context.timeout),
            lambda: move_here(src, dst),
        )

    def _on_every_rank(self, what: str, announce: Callable[[], None], run: Callable[[], T]) -> T:
        """Announce a step to the other ranks, then run it here; any failure fails the whole worker."""
        if self.ranks.failed:
            raise WorkerUnavailableError("a tensor-parallel rank of this target worker failed; it is restarting")
        try:
            announce()
            return run()
        except Exception as exc:
            # The ranks are out of step now (some may wait in a collective this rank left): the worker cannot go on.
            self.ranks.fail(f"{what} failed on rank 0: {type(exc).__name__}: {exc}")
            raise WorkerUnavailableError(
                "a tensor-parallel rank of this target worker failed; it is restarting"
            ) from exc

    def close(self) -> None:
        """On the model thread: the other ranks leave their loop and exit."""
        context = self.ranks.context
        self.ranks.stop(lambda: step.send_stop(context.control, context.device, context.timeout))


def load_engine(cfg: EngineConfig) -> ModelEngine:
    """One process, or ``cfg.tensor_parallel_size`` ranks with this process as rank 0."""
    return TensorParallelEngine.load(cfg) if cfg.tensor_parallel_size > 1 else ModelEngine.load(cfg)
