"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, gated MLP.

Numerics follow the reference implementation in transformers (norm in fp32,
rotary tables computed in fp32 and cast to the activation dtype), so that our
logits match theirs on the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.packed import packed_linear
from tandem.models.row_padding import DEFAULT_PADDING


@dataclass(frozen=True, slots=True)
class RowBlocks:
    """How a forward's flat token rows split for the linear layers; built once per forward.

    ``sizes`` are consecutive row counts in token order. A block flagged in ``prefill``
    is one sequence's prompt run (or any run too long for row by row) and gets a matmul call of its own;
    the other blocks hold the rows of short runs (decode, verify), whose kernel is
    row-invariant, so they may be grouped with anything.
    """

    sizes: tuple[int, ...]
    prefill: tuple[bool, ...]

    @classmethod
    def from_query_lens(cls, query_lens: list[int], max_short_run: int,
                        prompt_runs: list[bool] | None = None) -> RowBlocks:
        """A prompt run (``prompt_runs``) is a prefill block whatever its length, as a run too long for row by row."""
        prompts = prompt_runs if prompt_runs is not None else [False] * len(query_lens)
        sizes: list[int] = []
        prefill: list[bool] = []
        for qlen, prompt in zip(query_lens, prompts, strict=True):
            long_run = prompt or qlen > max_short_run
            if sizes and not long_run and not prefill[-1]:
                sizes[-1] += qlen  # consecutive short runs share one call
            else:
                sizes.append(qlen)
                prefill.append(long_run)
        return cls(tuple(sizes), tuple(prefill))


class RowStableLinear(nn.Linear):
    """A linear layer whose every output row is the same whether computed alone or in a batch.

    CPU, packed (fp32, and bf16 on a CPU that multiplies bf16 natively: what engines do
    by default, ``tandem.models.packed``): every call goes through ``packed_linear``,
    row-invariant at every row count, prompts included, and an extra row costs little.

    CPU, bf16 unpacked: rows of short runs (decode, verify) go through ``row_invariant_linear``,
    whose reduction order is fixed by the number of input features alone, so a token's
    output does not depend on how many rows share the call. A prefill run (a block
    flagged in ``RowBlocks``: one sequence's prompt chunk) gets a oneDNN call of its
    own (``onednn_linear``): its rows then depend on that chunk only, whatever else
    shares the forward pass, and prefill keeps oneDNN's speed.

    CPU, fp32 unpacked: MKL, whose kernels change with the row count (differences about
    1e-7): no bitwise promise then.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packed_weight: torch.Tensor | None = None  # oneDNN's blocked copy; replaces ``weight`` once set
        self.padding: tuple[int, ...] = DEFAULT_PADDING  # rows a small packed call computes (row_padding)
        self.max_call_rows: int | None = None  # most rows one packed call computes (row_invariance); None: any

    def reset_parameters(self) -> None:
        if self.weight.is_meta:  # a skeleton that a checkpoint fills (see ``building_on_meta``): nothing to initialise
            return
        super().reset_parameters()

    def forward(self, x: torch.Tensor, blocks: RowBlocks | None = None) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias, self.padding, self.max_call_rows)
        if x.dtype == torch.float32:
            return super().forward(x)
        if x.device.type != "cpu":
            return self._padded_forward(x)
        if blocks is None or not any(blocks.prefill):
            return row_invariant_linear(x, self.weight, self.bias)
        if len(blocks.sizes) == 1:
            return onednn_linear(x, self.weight, self.bias)
        pieces = [  # [rows, out] each
            onednn_linear(rows, self.weight, self.bias)
            if prefill
            else row_invariant_linear(rows, self.weight, self.bias)
            for rows, prefill in zip(x.split(blocks.sizes), blocks.prefill)
        ]
        return torch.cat(pieces)

    def _padded_forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        """CUDA: cuBLAS takes a matrix-vector kernel for one row; two rows take verification's.

        The original trick, kept as it was: untested here (no GPU), and cuBLAS may change
        kernels at larger row counts too.
        """
        if x.shape[0] != 1:
            return super().forward(x)
        return super().forward(torch.cat((x, torch.zeros_like(x)))).narrow(0, 0, 1)


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` on a CPU, each output row bitwise independent of the other rows.

    PyTorch sends a bf16 matmul of 2+ rows to oneDNN, whose reduction order over the
    input features changes with the row count: its GEMM driver splits that reduction
    between threads for some shapes and not others. Measured on an Intel Xeon without
    avx512_bf16, 2 threads, random inputs: Qwen2-0.5B's 896x151936 head rounds row 0
    one way at 1 row (ATen's gemv), another at 2-3 rows, a third at 4+. (With 1 thread
    2..128 rows agreed; on an AMD EPYC with avx512_bf16, 2..64 did: that is why padding
    a lone row to two used to be enough.) With oneDNN off, PyTorch uses ATen's own
    kernels, which compute every output element as one fp32-accumulated dot product
    over the input features (gemv for 1 row, the same dot per element for more), so the
    order is fixed by the number of input features: 1..128 rows agree bitwise on every
    shape we tried, with and without bias, and that holds whatever the CPU.

    The price is in rows, not bytes: the dot products convert and reduce per output
    element, so each extra row costs more than in oneDNN. Measured here (1 thread, CPU
    time, 896x9728): 1 row 3.4 ms either way (the old padding to 2 rows cost 5.5 ms),
    5 rows 12.5 ms against oneDNN's 7.5, 16 rows 35 against 16, 64 rows 138 against 48.
    Hence prefill runs, which are long and never compared with other rows, use oneDNN.
    """
    if _mkldnn_enabled():  # one flag for the whole process; fp32 (MKL) and int8 matmuls ignore it
        torch.backends.mkldnn.enabled = False
    return F.linear(x, weight, bias)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` through oneDNN, PyTorch's usual route for bf16, despite the flag above.

    Fast at many rows; its reduction order depends on the row count, so use it only
    where a call's rows are always the same set (one sequence's prompt chunk). Falls
    back to ``F.linear`` where oneDNN cannot run bf16 (no AVX512) or lacks the op.
    """
    if not _ONEDNN_BF16 or x.dtype == torch.float32 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn_bf16_available() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):  # a build without oneDNN, or an older one
        return False


_ONEDNN_BF16 = _onednn_bf16_available()
# The public property costs ~3 us a read, ~15x the C call behind it: this sits in every linear layer.
_mkldnn_enabled = getattr(torch._C, "_get_mkldnn_enabled", lambda: torch.backends.mkldnn.enabled)


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

    def forward(self, x: torch.Tensor, blocks: RowBlocks | None = None) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x, blocks).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up, blocks)


def building_on_meta() -> bool:
    """Whether modules are being built on the meta device (``with torch.device("meta")``), as skeletons that a
    checkpoint then fills (tandem/models/weights.py, tandem/heads/store.py).

    Such a build must compute nothing on meta tensors: an operation on one (an initialiser's ``normal_``, the
    rotary frequencies' arithmetic) runs torch's Python reference kernel, and the first one imports
    torch._dynamo, which cost every worker 1.3 s of its start-up (measured: SmolLM2 loaded in 2.6 s, 1.35 s
    without it, on an AMD EPYC Zen 3)."""
    return torch.get_default_device().type == "meta"


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
        # In a meta skeleton only the shape: the loader builds this module again for real (see ``building_on_meta``).
        inv_freq = torch.empty(head_dim // 2) if building_on_meta() else rope_inverse_frequencies(head_dim, theta,
                                                                                                   scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

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
