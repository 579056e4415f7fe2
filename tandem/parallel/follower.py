"""Ranks 1..N-1 of a tensor-parallel worker: load this rank's shard, then run every step rank 0 announces."""

from __future__ import annotations

import logging
import os
import signal

import torch

from tandem.config import EngineConfig, ModelConfig
from tandem.engine import ModelEngine
from tandem.models import load_model
from tandem.models.packed import pack_linear_weights
from tandem.models.row_padding import PaddingTuner
from tandem.models.tensor_parallel import ParallelModel
from tandem.parallel import step
from tandem.parallel.ranks import join_group
from tandem.parent_watch import watch_parent

log = logging.getLogger(__name__)


def run_follower(rank: int, world_size: int, port: int, cfg: EngineConfig, threads: int, parent_pid: int) -> None:
    """The child process's whole life; any error ends it non-zero, which fails the worker (rank 0's watchdog)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    # Rank 0 alone decides when the ranks stop (STOP, or its own death): Ctrl-C in a terminal reaches the
    # whole process group, and a rank that died of it first would turn a graceful drain into a failure.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    watch_parent(parent_pid, lambda: os._exit(1))  # rank 0 gone: leave at once, whatever the main thread is in
    torch.set_num_threads(threads)
    context = join_group(rank, world_size, port, cfg)
    model_cfg = ModelConfig.from_dir(cfg.model_dir)
    parallel = ParallelModel(context.shard, context.compute)
    model = load_model(cfg.model_dir, model_cfg, cfg.resolved_dtype, context.device, parallel)
    if cfg.pack_weights:  # as rank 0 does (TensorParallelEngine.load)
        pack_linear_weights(model, PaddingTuner())
    engine = ModelEngine.with_new_cache(model, cfg.num_blocks, cfg.block_size, cfg.attention_backend)
    torch.distributed.barrier(group=context.control)  # loaded: rank 0 waits for every rank here
    log.info("loaded its shard of %s; %d threads", cfg.model_dir, threads)
    while (message := step.receive(context.control, context.device)) is not None:
        if isinstance(message, step.KVMove):
            engine.move_kv(message.src, message.dst)  # keep_path on rank 0: the same copy of this rank's heads
        else:
            engine.compute(message)  # the logits are rank 0's to use; every rank gets them from the all-gather
    torch.distributed.destroy_process_group()

