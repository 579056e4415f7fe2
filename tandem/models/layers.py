"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, gated MLP.

Numerics follow the reference implementation in transformers (norm in fp32,
rotary tables computed in fp32 and cast to the activation dtype), so that our
logits match theirs on the same weights.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RowStableLinear(nn.Linear):
    """A linear layer whose every output row is the same whether computed alone or in a batch.

    oneDNN (and cuBLAS) pick a matrix-vector kernel for a single row and a
    matrix-matrix kernel for several, and the two sum in different orders;
    in bf16 the results then round differently now and then. Padding a
    single row to two makes decode steps use the kernel that verification
    uses, so a token's hidden state does not depend on how many tokens share
    its forward pass (measured here in bf16: rows agree bitwise for 2..64
    rows, not for 1). The padding row costs nothing measurable: the pass is
    bound by reading the weights. fp32 goes through MKL, whose kernels change
    below 8 rows; padding there would double the cost of a decode step for
    differences of 1e-7, so fp32 is left alone.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if x.shape[0] != 1 or x.dtype == torch.float32:
            return super().forward(x)
        return super().forward(torch.cat((x, torch.zeros_like(x)))).narrow(0, 0, 1)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = RowStableLinear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = RowStableLinear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, with linear or llama3 scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind, factor = scaling["rope_type"], float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, blend in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inverse_frequencies(head_dim, theta, scaling), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin tables ``[T, 1, head_dim]`` for absolute ``positions`` ``[T]``; computed once per forward."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` by the tables ``[T, 1, D]`` (half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
