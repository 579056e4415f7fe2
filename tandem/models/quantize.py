"""Weight-only int8 for draft models, and a draft vocabulary cut to its most common tokens.

A draft model's numbers never reach the user: every token it proposes is
checked by the target, and rejection sampling is lossless for *any* draft
distribution q as long as q is the distribution the draft actually sampled
from. So a draft may trade a little agreement with the target for speed,
and on a CPU a decode step is bound by reading the weights:

* int8 weights with one scale per output channel halve the bytes read.
  ``aten._weight_int8pack_mm`` dequantizes in registers; on the machine
  this was first written on it ran a 896x151936 bf16 matmul in 4.2 ms
  against 11.6 ms for bf16 weights. It works row by row, though, so a
  prompt's prefill may go faster on a dense weight: see ``Int8Linear``
  for when, and why no dense copy is kept beside the int8 one. (All of the
  draft's K/V then comes from the int8 weights.)
* Byte-level BPE vocabularies are ordered by merge rank, so the first ids
  are the most common tokens. Keeping lm_head rows for the first
  ``vocab_limit`` ids cuts Qwen's 151936-row head (27% of the 0.5B draft's
  weights) to a fraction; ids beyond the limit get logit -inf, so the draft
  never proposes them and the target supplies them when they are due.

Never apply either to a target: its logits define the output.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.config import native_cpu_bf16
from tandem.models.layers import RowBlocks, onednn_linear
from tandem.models.transformer import CausalLM

# Above this many rows a dense matmul may beat the int8 one (crossover measured at 8..32 rows where it does).
INT8_MAX_ROWS = 16
# ... and in bf16 on a CPU with native bf16, where a dense pass also pays dequantizing every weight. Whole
# prompt passes of the lean Qwen2.5-0.5B draft on a 2-core AMD EPYC Zen 5 (benchmarks/int8_rows.py, the two
# ways taking turns, as a draft worker's decode steps and prompt passes do): int8 faster up to about 80 rows
# (48: 146 against 191 ms; 64: 185 against 207; 80: 224 against 224; 128: 339 against 265). Run back to back,
# each way alone, dense won from about 50 rows (56: 146 against 155 ms); 64 sits between the two.
INT8_MAX_ROWS_NATIVE_BF16 = 64


class Int8Linear(nn.Module):
    """``y = x @ (q * scale).T + bias`` with ``q`` int8 ``[out, in]`` and one scale per output row.

    No dense copy of the weight is kept. A lean Qwen2.5-0.5B draft (int8, 32768-id
    head) in bf16 held one beside the int8 weights for prefill: 682 MB of its 1312 MB
    of tensors, so its RSS (1834 MB after a prefill and a decode step) exceeded the
    plain bf16 model's (1715 MB). Without it: 630 MB of tensors, RSS 1140 MB (in fp32,
    with load_model no longer keeping the checkpoint's mmap alive: 3441 -> 1600 MB).
    What prefill gained from the copy depends on the CPU, and a copy made per call
    gets most of it:

    * bf16 on a CPU without avx512_bf16/AMX (oneDNN emulates bf16): the int8 kernel
      beats the dense bf16 matmul at every row count measured (896x9728, 1 thread:
      1 row 1.7 vs 2.9 ms, 128 rows 71 vs 88 ms), and a whole 128-token prefill of
      that draft took 4.16 s through int8 against 4.33 s with the dense copy
      (512 tokens: 16.2 vs 16.8 s). The int8 kernel serves every input.
    * fp32: the int8 kernel has no fast path (896x9728 at 128 rows: 2.0 s against
      40 ms for MKL), so inputs of more than ``INT8_MAX_ROWS`` rows dequantize the
      weight for the call (a transient ``[out, in]`` tensor) and use MKL: the
      128-token prefill took 3.3 s that way, 1.7 s with a dense copy, 127 s in int8.
    * bf16 with avx512_bf16 or AMX: oneDNN's bf16 matmul is the faster one at
      prefill sizes, so long inputs dequantize for the call as in fp32; the dequantizing
      costs about 80-120 ms a pass for the 0.5B draft on 2 Zen 5 cores, so the int8
      kernel keeps inputs of up to ``INT8_MAX_ROWS_NATIVE_BF16`` rows (800-token prefill:
      1.25 s dense, 2.2 s int8; 16 rows: 141 ms dense, 62 ms int8).
    """

    def __init__(self, weight_q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight_q", weight_q)  # [out, in] int8
        self.register_buffer("scales", scales)  # [out], activation dtype
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight_q.shape

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """Symmetric per-row quantization of a float ``[out, in]`` weight."""
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [out]
        weight_q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(weight_q.contiguous(), scales.to(weight.dtype), None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor, blocks: RowBlocks | None = None) -> torch.Tensor:  # [T, in] -> [T, out]
        """``blocks`` is accepted for RowStableLinear's signature and ignored: drafts make no bitwise promise."""
        if _dense_beats_int8(x.dtype, x.shape[0]):
            return onednn_linear(x, self.dequantized(x.dtype), self.bias)
        out = torch.ops.aten._weight_int8pack_mm(x, self.weight_q, self.scales.to(x.dtype))  # [T, out]
        return out if self.bias is None else out + self.bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """``q * scale`` as a new ``[out, in]`` tensor of ``dtype``, for one call."""
        return self.weight_q * self.scales.to(dtype)[:, None]  # int8 * float promotes: one pass


_NATIVE_BF16 = native_cpu_bf16()


def _dense_beats_int8(dtype: torch.dtype, rows: int) -> bool:
    """Whether an input of ``rows`` rows is faster on a per-call dequantized weight (see Int8Linear)."""
    if dtype == torch.bfloat16:
        return _NATIVE_BF16 and rows > INT8_MAX_ROWS_NATIVE_BF16
    return rows > INT8_MAX_ROWS


def shrink_for_drafting(model: CausalLM, quantization: str, vocab_limit: int | None) -> CausalLM:
    """Make ``model`` a faster drafter in place: int8 linears and/or a head over the first ``vocab_limit`` ids."""
    head_rows = model.config.vocab_size if vocab_limit is None else min(vocab_limit, model.config.vocab_size)
    head_weight = model.lm_head.weight[:head_rows]  # [V', hidden]; a view, so a tied embedding stays shared
    if quantization == "int8":
        for layer in model.layers:  # the dense weights are freed as their modules go: see Int8Linear
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj = Int8Linear.from_weight(attn.qkv_proj.weight, attn.qkv_proj.bias)
            attn.o_proj = Int8Linear.from_weight(attn.o_proj.weight)
            mlp.gate_up_proj = Int8Linear.from_weight(mlp.gate_up_proj.weight)
            mlp.down_proj = Int8Linear.from_weight(mlp.down_proj.weight)
        model.lm_head = Int8Linear.from_weight(head_weight)  # scores few rows per sequence: int8 fits
    elif head_rows < model.config.vocab_size:
        if model.lm_head.weight is not model.embed_tokens.weight:
            head_weight = head_weight.clone()  # an untied head's other rows are freed with it
        head = nn.Linear(model.config.hidden_size, head_rows, bias=False)
        head.weight = nn.Parameter(head_weight, requires_grad=False)
        model.lm_head = head
    return model
