"""Weight-only int8 for draft models, and a draft vocabulary cut to its most common tokens.

A draft model's numbers never reach the user: every token it proposes is
checked by the target, and rejection sampling is lossless for *any* draft
distribution q as long as q is the distribution the draft actually sampled
from. So a draft may trade a little agreement with the target for speed,
and on a CPU a decode step is bound by reading the weights:

* int8 weights with one scale per output channel halve the bytes read.
  ``aten._weight_int8pack_mm`` dequantizes in registers; measured here it
  runs a 896x151936 bf16 matmul in 4.2 ms against 11.6 ms for bf16 weights.
  It works row by row, though: at 400 rows (a prompt's prefill) it took
  21.9 ms where the bf16 matmul took 9.2. So the dense weight is kept too,
  and inputs of more than ``INT8_MAX_ROWS`` rows use it. (The draft's cache
  then holds prompt K/V from the dense weights and drafted K/V from the
  int8 ones; both are the draft's guesses, which the target checks.)
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

from tandem.models.layers import RowBlocks
from tandem.models.transformer import CausalLM

# Above this many rows the dense matmul is faster than the int8 one (measured crossover: 8..32 rows).
INT8_MAX_ROWS = 16


class Int8Linear(nn.Module):
    """``y = x @ (q * scale).T + bias`` with ``q`` int8 ``[out, in]`` and one scale per output row.

    Inputs of more than ``INT8_MAX_ROWS`` rows go through ``dense_weight`` when one is kept.
    """

    def __init__(
        self,
        weight_q: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        dense_weight: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("weight_q", weight_q)  # [out, in] int8
        self.register_buffer("scales", scales)  # [out], activation dtype
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.dense_weight = dense_weight  # [out, in] float, or None
        self.out_features, self.in_features = weight_q.shape

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    keep_dense: bool = False) -> Int8Linear:
        """Symmetric per-row quantization of a ``[out, in]`` float weight."""
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [out]
        weight_q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(weight_q.contiguous(), scales.to(weight.dtype), None if bias is None else bias.detach().clone(),
                   weight.detach() if keep_dense else None)

    def forward(self, x: torch.Tensor, blocks: RowBlocks | None = None) -> torch.Tensor:  # [T, in] -> [T, out]
        """``blocks`` is accepted for RowStableLinear's signature and ignored: drafts make no bitwise promise."""
        if self.dense_weight is not None and x.shape[0] > INT8_MAX_ROWS:
            return nn.functional.linear(x, self.dense_weight, self.bias)
        out = torch.ops.aten._weight_int8pack_mm(x, self.weight_q, self.scales.to(x.dtype))
        return out if self.bias is None else out + self.bias


def shrink_for_drafting(model: CausalLM, quantization: str, vocab_limit: int | None) -> CausalLM:
    """Make ``model`` a faster drafter in place: int8 linears and/or a head over the first ``vocab_limit`` ids."""
    head_rows = model.config.vocab_size if vocab_limit is None else min(vocab_limit, model.config.vocab_size)
    head_weight = model.lm_head.weight[:head_rows]  # [V', hidden]; a view, so a tied embedding stays shared
    if quantization == "int8":
        for layer in model.layers:  # prefills keep the dense weights: see INT8_MAX_ROWS
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj = Int8Linear.from_weight(attn.qkv_proj.weight, attn.qkv_proj.bias, keep_dense=True)
            attn.o_proj = Int8Linear.from_weight(attn.o_proj.weight, keep_dense=True)
            mlp.gate_up_proj = Int8Linear.from_weight(mlp.gate_up_proj.weight, keep_dense=True)
            mlp.down_proj = Int8Linear.from_weight(mlp.down_proj.weight, keep_dense=True)
        model.lm_head = Int8Linear.from_weight(head_weight)  # one row per sequence: always int8
    elif head_rows < model.config.vocab_size:
        head = nn.Linear(model.config.hidden_size, head_rows, bias=False)
        head.weight = nn.Parameter(head_weight, requires_grad=False)
        model.lm_head = head
    return model
