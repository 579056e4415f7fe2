"""How many rows one call to a packed linear layer may compute with every row still bitwise its own.

Tandem's bitwise promises (greedy speculative output equal to target-only, a decoded token's KV equal
to the same token's prompt row, batching changing nothing) rest on each output row of a linear layer
being the same whatever other rows share the call (``tandem.models.packed``). oneDNN picks its kernel
by the row count, so that is a property of the kernels this machine's oneDNN picks, not of the maths:

- On an AMD EPYC (Zen 4/5, avx512_bf16) and on Intel Xeons without AMX, every kernel a packed weight
  met from 2 to 600 rows computed each row bitwise alike.
- On an Intel Xeon with AMX (family 6 model 207, bf16, 2 threads, torch 2.13's oneDNN), calls of up
  to 32 rows run one AMX kernel and calls of 33 or more another, which rounds some rows otherwise:
  in a 33-row call of Qwen2.5-1.5B's down projection (1536x8960), 13 rows differed from the same rows
  computed two at a time. A prompt's rows then differed from the same tokens decoded, and 21 tests of
  greedy identity and bitwise KV failed there.

So where oneDNN computes bf16 on AMX tiles, each packed weight shape is probed once at load
(``probe_call_limit``): rows computed in calls of each of ``PROBE_ROWS`` rows are compared with the same
rows computed two at a time, and a call of more rows than the limit found is split into calls of that
many (``tandem.models.packed.packed_linear``). A call never computes more rows than were probed, so the
promise covers every call the layer makes. Splitting costs only there: on the AMX Xeon, 256 rows
through 1536x8960 took 4.3 ms in one call and 6.4 ms in 32-row calls, and a whole 300-token prefill of
Qwen2.5-Coder-1.5B 1.72x (1,000 tokens: 1.22x), while decode and verify calls of up to 32 rows are
untouched; with oneDNN kept off AMX the same 256 rows took 43 ms (``benchmarks/row_split.py``).

Elsewhere (fp32 on any CPU, bf16 on avx512_bf16 without AMX) no probe runs and calls are not split:
those kernels measured invariant at every count tried, and a full probe costs what it computes (7.6 s
for Qwen2.5-1.5B's shapes in bf16 without AMX, 6.4 s of it the 151936x1536 head). The tests named
above check the promise on every machine they run on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# The row counts a packed call computes (``tandem.models.row_padding``: every count up to 32, then bucket sizes),
# probed at their kernel boundaries: small counts, each side of 16 and 32, and the first and last bucket of each
# octave up to 256. A call of more than the largest agreeing limit is split, so larger calls need no probe.
PROBE_ROWS = (3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 32, 34, 64, 68, 128, 136, 256)
# What a call may be limited to: the powers of two among them. A count between two of them that agrees proves
# little (a kernel that rounds otherwise flips about one output in 10,000: one in a 34-row call of SmolLM2's
# 576x1536 down projection), so the limit is the largest power of two up to which every probed count agreed.
LIMITS = (16, 32, 64, 128, 256)
# Rows compared at each count above 32 (every call of that count over them), against 32-row calls once those
# agree with two-row ones: enough outputs that a kernel which rounds otherwise is seen.
COMPARED_ROWS = 256
# Rows of the two-row reference (one row alone runs yet another kernel, ``tandem.models.packed``).
PAIRED_ROWS = 32
# Below this many rows a call may not be split: a prompt would pay a call per handful of rows, so the layer is
# better left unpacked (ATen's row-invariant bf16 path, or MKL in fp32 without the promise).
MIN_CALL_LIMIT = 16


def kernels_vary_by_rows(dtype: torch.dtype) -> bool:
    """Whether this CPU computes ``dtype`` on AMX tiles, where oneDNN's kernels round rows by the call's row count."""
    try:
        return dtype == torch.bfloat16 and bool(torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a build without the probe
        return False


def probe_call_limit(call: Callable[[torch.Tensor], torch.Tensor], in_features: int, dtype: torch.dtype,
                     seed: int = 0) -> int:
    """The most rows one call may compute with each row bitwise what two-row calls give it.

    ``call``: x [T, in_features] -> [T, out], the layer's kernel at exactly T rows (no padding, no split).
    Returns the largest of ``LIMITS`` up to which every count in ``PROBE_ROWS`` agreed; 2 when none did.
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(COMPARED_ROWS, in_features, generator=generator).to(dtype)  # [COMPARED_ROWS, in]
    with torch.inference_mode():
        reference = torch.cat([call(x[i : i + 2]) for i in range(0, PAIRED_ROWS, 2)])  # [PAIRED_ROWS, out]
        limit = 2
        for rows in PROBE_ROWS:
            if rows <= PAIRED_ROWS:
                agrees = torch.equal(call(x[:rows]), reference[:rows])
            else:
                covered = COMPARED_ROWS // rows * rows
                agrees = all(torch.equal(call(x[i : i + rows]), reference[i : i + rows])
                             for i in range(0, covered, rows))
            if not agrees:
                return limit
            if rows == PAIRED_ROWS:  # 32-row calls agree with two-row ones: the reference for the larger counts
                reference = torch.cat([call(x[i : i + rows]) for i in range(0, COMPARED_ROWS, rows)])
            if rows in LIMITS:
                limit = rows
    return limit
