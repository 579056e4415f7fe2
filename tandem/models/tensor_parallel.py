"""Tensor parallelism applied to a built ``CausalLM`` (gpt-fast style): the model code knows nothing of it.

Rank ``r`` of ``N`` keeps (Megatron's split, one all-reduce per sub-layer):

* q, k, v (weights and biases) and gate, up: its ``1/N`` of the output features
  ("column-parallel"), i.e. ``num_heads/N`` query heads, ``num_kv_heads/N`` KV heads
  and ``intermediate_size/N`` MLP channels; its KV cache holds only its own KV heads,
  so the same KV pool in tokens costs ``1/N`` of the memory per rank;
* o_proj and down_proj: the matching ``1/N`` of the input features ("row-parallel"),
  each followed by ONE all-reduce (sum) of its ``[T, hidden]`` output;
* lm_head: a ``ceil(vocab/N)``-row slice of the vocabulary, all-gathered into full
  ``[R, vocab]`` logits, so sampling sees the whole distribution;
* embedding and norms: whole (the embedding is a lookup, not a matmul).

The split is defined once here: :func:`split_dim` says which dimension of a parameter is
split and :func:`part_range` which indices rank ``r`` keeps, and both ``parallelize``
(shapes, on a meta or a loaded model) and the loader (``tandem.models.weights``, which
reads only those slices from the checkpoint) use them. Fused parameters (qkv, gate_up)
are split per part, so each rank's fused weight is its q, k and v slices concatenated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.config import ModelConfig
from tandem.errors import InvalidRequestError
from tandem.models.transformer import CausalLM

# Our parameter (its name past "layers.N.") -> the dimension tensor parallelism splits.
_COLUMN, _ROW = 0, 1
_SPLIT_DIMS = {
    "self_attn.qkv_proj.weight": _COLUMN,
    "self_attn.qkv_proj.bias": _COLUMN,
    "mlp.gate_up_proj.weight": _COLUMN,
    "self_attn.o_proj.weight": _ROW,
    "mlp.down_proj.weight": _ROW,
}


@dataclass(frozen=True, slots=True)
class Shard:
    """Which part of the model one process holds: rank ``rank`` of ``world_size``."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside 0..{self.world_size - 1}")

    @property
    def is_whole(self) -> bool:
        return self.world_size == 1


def check_splittable(cfg: ModelConfig, world_size: int) -> None:
    """Refuse, naming why, a model whose heads or MLP do not split evenly over ``world_size`` ranks.

    The vocabulary needs no such rule: lm_head slices are ``ceil(vocab/N)`` rows, the last
    one shorter, and the gathered logits are cut back to ``vocab``.
    """
    if world_size < 1:
        raise InvalidRequestError(f"tensor-parallel size must be at least 1, got {world_size}")
    problems = [
        f"{what} ({count})"
        for what, count in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                            ("MLP intermediate size", cfg.intermediate_size))
        if count % world_size
    ]
    if problems:
        raise InvalidRequestError(
            f"cannot split this model over {world_size} tensor-parallel ranks: its {' and '.join(problems)} "
            f"{'is' if len(problems) == 1 else 'are'} not divisible by {world_size} (each rank keeps whole heads; "
            f"pick a tensor-parallel size that divides {cfg.num_heads} heads and {cfg.num_kv_heads} KV heads)"
        )


def split_dim(name: str) -> int | None:
    """The dimension of our parameter ``name`` that ranks split (None: every rank keeps it whole)."""
    if name == "lm_head.weight":
        return _COLUMN  # vocabulary rows
    _, _, suffix = name.partition("layers.")
    return _SPLIT_DIMS.get(suffix.partition(".")[2]) if suffix else None


def part_range(length: int, shard: Shard) -> tuple[int, int]:
    """Indices ``[start, stop)`` of a ``length``-long split dimension that ``shard`` keeps.

    ``ceil(length/N)`` per rank, the last ones shorter (only the vocabulary is ever uneven).
    """
    per_rank = -(-length // shard.world_size)
    return min(shard.rank * per_rank, length), min((shard.rank + 1) * per_rank, length)


def shard_tensor(value: torch.Tensor, name: str, part_sizes: list[int], shard: Shard) -> torch.Tensor:
    """This rank's slice of a whole parameter ``value`` made of ``part_sizes`` fused along dim 0."""
    dim = split_dim(name)
    if dim is None or shard.is_whole:
        return value
    if dim == _ROW:
        start, stop = part_range(value.shape[1], shard)
        return value[:, start:stop]
    pieces = []
    for part in value.split(part_sizes, dim=0):
        start, stop = part_range(part.shape[0], shard)
        pieces.append(part[start:stop])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def fused_part_sizes(cfg: ModelConfig, name: str) -> list[int]:
    """The checkpoint tensors' lengths along dim 0 that our parameter ``name`` concatenates."""
    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [q, kv, kv]
    if name.endswith("gate_up_proj.weight"):
        return [cfg.intermediate_size, cfg.intermediate_size]
    if name == "lm_head.weight":
        return [cfg.vocab_size]
    return []


@dataclass(slots=True)
class CollectiveClock:
    """Seconds this rank spent in its all-reduces and all-gathers, and in rank 0's step broadcasts.

    Off by default (two clock reads per collective); benchmarks turn it on. A collective's time
    includes waiting for the slowest rank to arrive.
    """

    enabled: bool = False
    seconds: float = 0.0
    calls: int = 0
    broadcast_seconds: float = 0.0

    def reset(self) -> None:
        self.seconds, self.calls, self.broadcast_seconds = 0.0, 0, 0.0


@dataclass(slots=True)
class ParallelModel:
    """What :func:`parallelize` did to a model: its shard, its group, and a clock for its collectives."""

    shard: Shard
    group: Any  # torch.distributed ProcessGroup (None: the default group)
    clock: CollectiveClock = field(default_factory=CollectiveClock)


def parallelize(model: CausalLM, parallel: ParallelModel) -> CausalLM:
    """Cut ``model`` (loaded, or built on the meta device) down to ``parallel.shard``'s part, in place.

    Parameters shrink to this rank's slices and the head counts to its heads; forward hooks
    add the all-reduce after o_proj and down_proj and the all-gather after lm_head. A whole
    shard (one rank) changes nothing.
    """
    shard = parallel.shard
    if shard.is_whole:
        return model
    cfg = model.config
    check_splittable(cfg, shard.world_size)
    for name, module in model.named_modules():
        for param_name, param in list(module.named_parameters(recurse=False)):
            full = f"{name}.{param_name}" if name else param_name
            if cfg.tie_word_embeddings and full == "lm_head.weight":
                continue  # the embedding, kept whole; the head becomes a view of its rows below
            sliced = shard_tensor(param.data, full, fused_part_sizes(cfg, full), shard)
            if sliced is not param.data:
                setattr(module, param_name, nn.Parameter(sliced.contiguous(), requires_grad=False))
    if cfg.tie_word_embeddings:
        start, stop = part_range(cfg.vocab_size, shard)
        model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.data[start:stop], requires_grad=False)
    for layer in model.layers:
        attn = layer.self_attn
        attn.num_heads //= shard.world_size
        attn.num_kv_heads //= shard.world_size
        attn.q_size = attn.num_heads * attn.head_dim
        attn.kv_size = attn.num_kv_heads * attn.head_dim
        for row_parallel in (attn.o_proj, layer.mlp.down_proj):
            row_parallel.register_forward_hook(_all_reduce_hook(parallel))
    model.lm_head.register_forward_hook(_gather_vocab_hook(parallel, cfg.vocab_size))
    return model


def local_kv_heads(model: CausalLM) -> int:
    """KV heads this process's copy of ``model`` computes (all of them unless it was parallelized)."""
    return model.layers[0].self_attn.num_kv_heads if len(model.layers) else model.config.num_kv_heads


def _all_reduce_hook(parallel: ParallelModel):
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:  # out [T, hidden], a partial sum
        started = time.perf_counter() if parallel.clock.enabled else 0.0
        dist.all_reduce(out, group=parallel.group)  # [T, hidden], the whole sum on every rank
        _tick(parallel.clock, started)
        return out

    return hook


def _gather_vocab_hook(parallel: ParallelModel, vocab_size: int):
    world = parallel.shard.world_size
    per_rank = -(-vocab_size // world)

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:  # out [R, rows of this rank]
        started = time.perf_counter() if parallel.clock.enabled else 0.0
        if out.shape[-1] < per_rank:  # the last slice of an uneven vocabulary: pad to the common width
            out = nn.functional.pad(out, (0, per_rank - out.shape[-1]))
        pieces = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(pieces, out.contiguous(), group=parallel.group)  # world x [R, per_rank]
        _tick(parallel.clock, started)
        return torch.cat(pieces, dim=-1)[:, :vocab_size]  # [R, vocab]

    return hook


def _tick(clock: CollectiveClock, started: float) -> None:
    if clock.enabled:
        clock.seconds += time.perf_counter() - started
        clock.calls += 1
