"""The WorkerInfo message both worker roles answer Info with."""

from __future__ import annotations

from tandem.engine import ModelEngine
from tandem.v1 import common_pb2


def worker_info(role: str, model_name: str, engine: ModelEngine, queue_depth: int, active_sequences: int,
                fingerprint: str, stop_token_ids: list[int]) -> common_pb2.WorkerInfo:
    cache = engine.kv_cache
    return common_pb2.WorkerInfo(
        role=role, model=model_name, vocab_size=engine.config.vocab_size,
        max_context=engine.config.max_position_embeddings, total_blocks=cache.num_blocks,
        free_blocks=cache.num_free_blocks, block_size=cache.block_size, queue_depth=queue_depth,
        active_sequences=active_sequences, tokenizer_fingerprint=fingerprint, stop_token_ids=stop_token_ids,
    )
