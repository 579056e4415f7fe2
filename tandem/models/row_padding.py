"""How many rows a small call to a packed linear layer computes: the cheapest count, measured per shape.

oneDNN picks its kernel by the row count, and the cheapest is not the smallest: on an AMD EPYC
(Zen 4, bf16, 2 threads) the Qwen2.5-Coder-1.5B forward of one new token cost 192 ms, of five
155 ms, because one and two rows take slower kernels than three to nine. Every plain decoding
step (the target-only baseline, k = 0 rounds, a lean draft's batch-1 steps) paid it.

Every row of a call over a packed weight is bitwise the same from two rows up whatever the
other rows (``tandem.models.packed``), so a call of T rows may compute more rows (zeros) and
keep its first T: the result is unchanged, only the kernel differs. ``measure_padding`` times
2..``MAX_PADDED_ROWS`` rows for one weight once, at load, and gives each small T the count
>= max(T, 2) that measured cheapest. Layers of one shape share the measurement
(``PaddingTuner``), so a model pays a few hundred milliseconds once.

Calls of more than ``BUCKETED_FROM`` rows compute the next of ``BUCKETS_PER_OCTAVE`` sizes per
doubling (at most 1/16 more rows), for memory: oneDNN builds and keeps a kernel for every row count
a packed weight is called with, the buffers of so many sizes leave freed memory that glibc keeps
(most of the growth on Qwen2.5-1.5B's shapes), and a serving worker meets every count from one to its token
budget (streams x tokens per round, prompt chunks). Called twice with every count from 2 to 2,048,
SmolLM2's four layer shapes (bf16, AMD EPYC Zen 4) added 1,690 MB to a worker-sized process (2,265
in another run), and the second pass rebuilt kernels (oneDNN's cache holds 1,024); through the 127
sizes these buckets leave, 379 MB, and the second pass took 37.7 s against 49.1 s although it
computed up to 6% more rows. A prefill pays about the rows it adds (``benchmarks/row_buckets.py``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from tandem.models.row_invariance import kernels_vary_by_rows, probe_call_limit

# Row counts above this are never padded: past a handful of rows every kernel reads the weight once.
MAX_PADDED_ROWS = 8
# One row runs another kernel than every other count (not row-invariant), so it is always padded to two
# at least: the layout without measurement.
DEFAULT_PADDING: tuple[int, ...] = (0, 2)
# A count is chosen over the smallest allowed one only if it measured this much cheaper: timing noise must
# not turn into a choice.
MIN_GAIN = 0.05
# Calls of more rows than this compute a bucket's size: BUCKETS_PER_OCTAVE sizes between each power of two and
# the next (33..64 rows in steps of 2, 65..128 in steps of 4, ...). A power of two, so that the sizes are too.
BUCKETED_FROM = 32
BUCKETS_PER_OCTAVE = 16


def padded_rows(padding: tuple[int, ...], rows: int) -> int:
    """How many rows a call of ``rows`` computes: ``padding[rows]`` for the small counts it lists, the count
    itself up to ``BUCKETED_FROM``, the bucket's size above."""
    if rows < len(padding):
        return padding[rows]
    return bucket_rows(rows) if rows > BUCKETED_FROM else rows


def bucket_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of 1/BUCKETS_PER_OCTAVE of the power of two below it (its octave's step)."""
    octave_floor = 1 << ((rows - 1).bit_length() - 1)  # the largest power of two < rows (rows > 1)
    step = max(1, octave_floor // BUCKETS_PER_OCTAVE)
    return -(-rows // step) * step


def choose_padding(cost_ms: dict[int, float]) -> tuple[int, ...]:
    """``padding[T]`` for T in 0..max measured: the cheapest measured count >= max(T, 2).

    ``cost_ms`` maps row counts (2..MAX_PADDED_ROWS) to measured times. The cheapest larger count
    replaces the smallest allowed one only when it is more than ``MIN_GAIN`` cheaper than it.
    """
    counts = sorted(cost_ms)
    if not counts or counts[0] != 2:
        raise ValueError(f"padding needs the cost of 2 rows and up, got counts {counts}")
    padding = [0]
    for rows in range(1, counts[-1] + 1):
        floor = max(rows, 2)
        cheapest = min((count for count in counts if count >= floor), key=lambda count: (cost_ms[count], count))
        padding.append(cheapest if cost_ms[cheapest] < cost_ms[floor] * (1 - MIN_GAIN) else floor)
    return tuple(padding)


def measure_padding(packed: torch.Tensor, in_features: int, bias: torch.Tensor | None, dtype: torch.dtype,
                    repeats: int = 7) -> tuple[tuple[int, ...], dict[int, float]]:
    """Time one packed weight at 2..MAX_PADDED_ROWS rows (median of ``repeats`` calls each, after a warm-up
    call); returns (padding, the medians in ms)."""
    calls: dict[int, Callable[[], object]] = {}
    for rows in range(2, MAX_PADDED_ROWS + 1):
        x = torch.zeros(rows, in_features, dtype=dtype)  # [rows, in]
        calls[rows] = partial(torch.ops.mkldnn._linear_pointwise, x, packed, bias, "none", [], "")
        calls[rows]()  # the kernel's first-call setup
    cost_ms = median_times_ms(calls, repeats)
    return choose_padding(cost_ms), cost_ms


def median_times_ms(calls: dict[int, Callable[[], object]], repeats: int,
                    clock: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """The median time of each call over ``repeats`` timings, taken in turns (one of each, ``repeats``
    times): the counts are a few per cent apart, and a burst of load on the machine must slow all of
    them alike. Timed one count after another, a burst while one count was measured made it look dear,
    and a lone row was padded to 3-6 rows at load (measured on a 2-core AMD EPYC)."""
    times: dict[int, list[float]] = {key: [] for key in calls}
    for _ in range(repeats):
        for key, call in calls.items():
            start = clock()
            call()
            times[key].append(clock() - start)
    return {key: statistics.median(taken) * 1e3 for key, taken in times.items()}


@dataclass(slots=True)
class PaddingTuner:
    """Measures each distinct packed weight shape once (per dtype and bias) and remembers the padding, and
    the most rows one call may compute row-invariantly (``tandem.models.row_invariance``)."""

    chosen: dict[tuple[int, int, str, bool], tuple[int, ...]] = field(default_factory=dict)
    costs: dict[tuple[int, int, str, bool], dict[int, float]] = field(default_factory=dict)
    call_limits: dict[tuple[int, int, str, bool], int | None] = field(default_factory=dict)

    def padding_for(self, packed: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None,
                    dtype: torch.dtype) -> tuple[int, ...]:
        key = _shape_key(out_features, in_features, bias, dtype)
        if key not in self.chosen:
            self.chosen[key], self.costs[key] = measure_padding(packed, in_features, bias, dtype)
        return self.chosen[key]

    def call_limit_for(self, packed: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None,
                       dtype: torch.dtype) -> int | None:
        """The most rows one call of this shape may compute (``tandem.models.row_invariance``); None: any."""
        if not kernels_vary_by_rows(dtype):
            return None
        key = _shape_key(out_features, in_features, bias, dtype)
        if key not in self.call_limits:
            call = partial(_exact_call, packed=packed, bias=bias)
            self.call_limits[key] = probe_call_limit(call, in_features, dtype)
        return self.call_limits[key]


def _shape_key(out_features: int, in_features: int, bias: torch.Tensor | None,
               dtype: torch.dtype) -> tuple[int, int, str, bool]:
    return out_features, in_features, str(dtype).removeprefix("torch."), bias is not None


def _exact_call(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear over a packed weight at exactly x's rows: x [T, in] -> [T, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
