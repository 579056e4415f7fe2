"""Linear layers on a CPU through oneDNN, with each weight reordered once into its blocked layout.

Why: speculative decoding pays when a forward of k+1 tokens costs about what a
forward of one token costs (the weights are read once either way). PyTorch's own
routes make extra rows dear on a CPU:

- fp32 goes to MKL, which runs one row as a matrix-vector product but packs the
  whole weight again on every call of 4 or more rows: on an Intel Xeon (2 threads,
  1536x8960) 1 row took 2.8 ms, 5 rows 7.9 ms, 16 rows 8.0 ms. Packed once: 5 rows
  3.6 ms, 16 rows 4.1 ms; the Qwen2.5-Coder-1.5B forward of 5 new tokens went from
  1.97x to 0.95-1.2x a forward of one (``benchmarks/README.md``).
- bf16 rows of short runs went through ATen's per-element dot products
  (``tandem.models.layers.row_invariant_linear``), row-invariant but paying each
  row in full. On an AMD EPYC (Zen 5, avx512_bf16, 2 threads), 17920x1536: 1 row
  1.14 ms, 5 rows 5.76, 16 rows 17.2; the whole 1.5B forward of 5 new tokens cost
  4.05x a forward of one, and speculation ran at 0.85x target-only. The same weight
  packed for oneDNN: 1 row (padded) 1.14 ms, 5 rows 0.86, 16 rows 1.42; the
  151936x1536 head 6.9 / 7.8 / 12.9 ms against ATen's 9.1 / 41.8 / 150 at 1 / 5 / 16.

bf16 is packed only on a CPU that multiplies it natively (avx512_bf16 or AMX): elsewhere
oneDNN emulates bf16 and the dtype that ``auto`` picks there is fp32 anyway.

Row invariance, measured (fp32 on the Xeon, 2..600 rows; bf16 on the EPYC, 2..300 rows; 1
and 2 threads, the Qwen and SmolLM2 layer shapes, with and without bias): oneDNN's kernel
over a packed weight computes each output row bitwise the same whatever the other rows,
from 2 rows up. One row takes another kernel, so a lone row is padded to two at least; small
calls compute the row count that measured cheapest for their weight (``tandem.models.row_padding``).
That gives a packed model the promise that a token's logits do not depend on how many
tokens share the forward pass, so greedy speculative output is bitwise the target's
alone, and batching changes nothing. Another instruction set may pick other kernels: on an
Intel Xeon with AMX, bf16 calls of more than 32 rows round rows otherwise, so each shape is
probed at load and larger calls are split (``tandem.models.row_invariance``);
``tests/test_engine_rollback_and_batching.py`` checks the promise on the machine it runs on.

Memory: the packed copy replaces the dense weight (same bytes). A head tied to the
embedding keeps the embedding dense for lookups, so a tied head costs one extra
copy of the embedding matrix (Qwen2.5-Coder-1.5B: 0.93 GB in fp32). oneDNN also keeps a kernel
per row count a packed weight meets, so calls above 32 rows compute one of a few sizes per octave
(``tandem.models.row_padding``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.row_invariance import MIN_CALL_LIMIT
from tandem.models.row_padding import DEFAULT_PADDING, PaddingTuner, padded_rows

logger = logging.getLogger(__name__)

# Below this many weight elements a layer keeps its dense weight (MKL in fp32, ATen in bf16): oneDNN's
# fixed cost per call (tens of microseconds, milliseconds for some row counts on tiny shapes) exceeds
# anything packing saves.
# Measured on the Xeon (busy at the time): a 64x128 weight took 3.6 ms a call packed at 37 rows,
# microseconds on MKL. Every layer of SmolLM2 (the smallest, 576x576 = 331,776) and of the Qwen
# models is above it.
MIN_PACKED_ELEMENTS = 1 << 18
# bf16 only where the CPU multiplies it natively: EngineConfig decides (tandem.config.native_cpu_bf16).
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packing_supported() -> bool:
    """Whether this PyTorch can reorder a weight for oneDNN and run a linear layer on it."""
    try:
        return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] fp32 or bf16 on the CPU, reordered into oneDNN's blocked layout (an opaque tensor)."""
    if weight.dtype not in PACKED_DTYPES or weight.device.type != "cpu":
        raise ValueError(f"only fp32 and bf16 CPU weights are packed, got {weight.dtype} on {weight.device}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  padding: tuple[int, ...] = DEFAULT_PADDING, max_rows: int | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` [T, in] over a packed weight; every row bitwise independent of the others.

    A call of T rows computes ``padding[T]`` rows (zeros past T) where the table has an entry: one row
    runs another kernel (padded, it runs the kernel every other call runs), and some small counts run
    slower kernels than a few more rows would (``tandem.models.row_padding``). More than ``max_rows``
    rows (the weight's probed limit, ``tandem.models.row_invariance``) go in calls of at most that many.
    """
    rows = x.shape[0]
    if max_rows is not None and rows > max_rows:
        return torch.cat([packed_linear(piece, packed, bias, padding) for piece in x.split(max_rows)])  # [T, out]
    computed = padded_rows(padding, rows)
    if computed != rows:
        return torch.ops.mkldnn._linear_pointwise(F.pad(x, (0, 0, 0, computed - rows)), packed, bias,
                                                  "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linear_weights(model: nn.Module, tuner: PaddingTuner | None = None) -> int:
    """Pack the weight of every ``RowStableLinear`` in ``model`` in place; the number of layers packed.

    With ``tuner``, each packed layer's small calls compute the row count measured cheapest for its
    shape (``tandem.models.row_padding``); without, a lone row is padded to two. Either way, where kernels
    vary with the row count (bf16 on AMX), each shape is probed for the most rows one call may compute
    row-invariantly (``tandem.models.row_invariance``), and one whose kernels vary below ``MIN_CALL_LIMIT``
    rows stays dense.

    Each layer's dense weight is dropped as its packed copy is made (so peak memory
    grows by one layer, not one model); a weight shared with another module (a
    head tied to the embedding) stays alive there. Layers smaller than
    ``MIN_PACKED_ELEMENTS`` (test-sized models) stay dense: on MKL in fp32, without the
    bitwise promise; on ATen's row-invariant dot products in bf16.
    """
    from tandem.models.layers import RowStableLinear  # layers imports packed_linear from here

    limits = tuner if tuner is not None else PaddingTuner()  # the call limit is probed with or without a tuner
    packed = 0
    left_dense: set[tuple[int, int]] = set()  # shapes already warned of
    for module in model.modules():
        if (isinstance(module, RowStableLinear) and module.packed_weight is None
                and module.weight.numel() >= MIN_PACKED_ELEMENTS):
            weight = pack_weight(module.weight)
            out_features, in_features = module.weight.shape  # a tensor-parallel shard's, not the layer's declared one
            limit = limits.call_limit_for(weight, out_features, in_features, module.bias, module.weight.dtype)
            if limit is not None and limit < MIN_CALL_LIMIT:  # rows vary by the call: the dense path keeps the promise
                if (out_features, in_features) not in left_dense:
                    left_dense.add((out_features, in_features))
                    logger.warning("%dx%d %s linear layers stay unpacked: oneDNN's kernels for them compute a row "
                                   "differently in calls of more than %d rows", out_features, in_features,
                                   str(module.weight.dtype).removeprefix("torch."), limit)
                continue
            module.packed_weight = weight
            module.max_call_rows = limit
            if tuner is not None:
                module.padding = tuner.padding_for(weight, out_features, in_features, module.bias, module.weight.dtype)
            module.weight = None  # the name stays registered, empty; the tensor is freed unless shared
            packed += 1
    return packed
