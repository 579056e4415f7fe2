"""Sizing a GPU worker's KV pool from the device's memory (``--gpu-memory-utilization``), as vLLM does.

A pool of ``--kv-cache-tokens`` leaves most of a large GPU idle (65,536 tokens of a 1.5B model's KV are
1.8 GiB of an H200's 139), and a user would have to work out how many tokens fit. Given a fraction F of the
device's memory instead, the worker, once its weights are loaded, runs one forward of ``PROFILE_TOKENS``
prompt tokens on a scratch pool to measure the activations' peak, then gives the KV pool what is left:

    kv bytes = F x total - (memory in use now, by this process and any other) - activation peak - headroom

``headroom`` is for what is allocated after sizing: CUDA graphs' memory pool (captured at warm-up), the
sampler's buffers, the allocator's fragmentation. What is in use counts other processes' memory too (a draft
worker on the target's GPU): two workers on one device are each given their share, summing below 1.

The device's memory is read through ``DeviceMemory``; only CUDA has one here (a CPU worker keeps its
``--kv-cache-tokens``), and the tests pass their own.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

    from tandem.config import EngineConfig
    from tandem.models.transformer import CausalLM

GIB = 1 << 30
# Prompt tokens of the profiling forward (fewer where the model's context is shorter). A step's activations grow
# with its tokens, and a lone prompt may be computed whole whatever the token budget: profiled at this length, a
# prompt up to it fits; a longer one computed in one step may not (--prefill-chunk-tokens N bounds a step).
PROFILE_TOKENS = 32768
# Kept free beyond the measured peak: CUDA graphs' pool, sampling, fragmentation (vLLM keeps a similar margin).
HEADROOM_BYTES = GIB


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """What a worker needs of its device's memory: the total, what is free now, and the activation peak of a
    forward (bytes). ``profile`` runs the forward it is given and returns its peak above what was allocated."""

    total: Callable[[], int]
    free: Callable[[], int]
    profile: Callable[[Callable[[], None]], int]


def cuda_memory(device: torch.device) -> DeviceMemory:
    import torch

    def free() -> int:
        gc.collect()  # the profile's scratch engine, should a cycle hold it
        torch.cuda.empty_cache()  # the allocator's cached blocks are ours to reuse: not in use
        return torch.cuda.mem_get_info(device)[0]

    def profile(forward: Callable[[], None]) -> int:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        forward()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before

    return DeviceMemory(lambda: torch.cuda.mem_get_info(device)[1], free, profile)


def kv_bytes_per_token(model: CausalLM, num_layers: int | None = None) -> int:
    """K and V of one token in every layer this process holds, in the weights' dtype."""
    from tandem.models.tensor_parallel import local_kv_heads

    cfg = model.config
    element = model.embed_tokens.weight.element_size()
    return 2 * (num_layers or cfg.num_layers) * local_kv_heads(model) * cfg.head_dim * element


@dataclass(frozen=True, slots=True)
class KvBudget:
    """How a pool was sized, for the worker's log and its errors (bytes, and the tokens it gives)."""

    utilization: float
    total: int
    in_use: int  # by this process (weights) and any other, after the profile's memory went back
    activation_peak: int
    headroom: int
    bytes_per_token: int
    tokens: int
    profile_tokens: int  # the prompt length whose forward gave ``activation_peak``

    def describe(self) -> str:
        return (f"KV pool of {self.tokens} tokens ({self.tokens * self.bytes_per_token / GIB:.1f} GiB) from "
                f"{self.utilization:g} of the device's {self.total / GIB:.1f} GiB: {self.in_use / GIB:.1f} GiB in use "
                f"(the weights, and other processes'), {self.activation_peak / GIB:.2f} GiB of activations at "
                f"{self.profile_tokens} prompt tokens, {self.headroom / GIB:.1f} GiB kept free")


def size_pool(utilization: float, total: int, in_use: int, activation_peak: int, bytes_per_token: int,
              block_size: int, headroom: int = HEADROOM_BYTES, profile_tokens: int = PROFILE_TOKENS) -> KvBudget:
    """The pool's tokens (whole blocks) in what ``utilization`` of ``total`` leaves; an error naming the figures
    when not one block fits."""
    room = int(utilization * total) - in_use - activation_peak - headroom
    tokens = max(0, room) // bytes_per_token // block_size * block_size
    budget = KvBudget(utilization, total, in_use, activation_peak, headroom, bytes_per_token, tokens, profile_tokens)
    if tokens < block_size:
        raise InvalidRequestError(
            f"--gpu-memory-utilization {utilization:g} leaves no room for a KV block: {utilization:g} of the "
            f"device's {total / GIB:.1f} GiB is {utilization * total / GIB:.1f} GiB, and {in_use / GIB:.1f} GiB are "
            f"in use (the weights, and other processes'), {activation_peak / GIB:.2f} GiB go to activations, "
            f"{headroom / GIB:.1f} GiB are kept free; raise the fraction, or give --kv-cache-tokens")
    return budget


def kv_budget(model: CausalLM, cfg: EngineConfig, memory: DeviceMemory) -> KvBudget:
    """The pool ``cfg.gpu_memory_utilization`` gives ``model`` (loaded on its device) on the device ``memory``
    reads: its activations profiled first, then what is in use read once their memory went back."""
    assert cfg.gpu_memory_utilization is not None
    tokens = min(PROFILE_TOKENS, model.config.max_position_embeddings)
    peak = profile_activations(model, cfg.block_size, cfg.attention_backend, memory, tokens)
    total = memory.total()
    return size_pool(cfg.gpu_memory_utilization, total, total - memory.free(), peak, kv_bytes_per_token(model),
                     cfg.block_size, profile_tokens=tokens)


def profile_activations(model: CausalLM, block_size: int, attention_backend: str, memory: DeviceMemory,
                        tokens: int = PROFILE_TOKENS) -> int:
    """The activation peak of one forward of ``tokens`` prompt tokens, on a scratch pool just large enough, freed
    before this returns."""
    from tandem.engine import ForwardItem, ModelEngine

    scratch = ModelEngine.with_new_cache(model, -(-tokens // block_size), block_size, attention_backend)
    item = ForwardItem("__profile__", [1] * tokens, num_logits=1, prompt=True)
    return memory.profile(lambda: scratch.forward([item]))  # (the scratch pool goes with this frame)
