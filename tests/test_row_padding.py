"""Small packed calls compute the row count measured cheapest, and every row stays bitwise what a batch gives."""

from __future__ import annotations

import pytest
import torch

from tandem.models.row_padding import (
    BUCKETED_FROM,
    BUCKETS_PER_OCTAVE,
    DEFAULT_PADDING,
    MAX_PADDED_ROWS,
    PaddingTuner,
    bucket_rows,
    choose_padding,
    median_times_ms,
    padded_rows,
)


def test_each_small_count_takes_the_cheapest_count_at_or_above_it():
    # Two rows slower than three to five (the shape seen on an AMD EPYC), six and up dearer again; three and
    # four are within MIN_GAIN of five, so they compute themselves.
    costs = {2: 1.14, 3: 0.90, 4: 0.88, 5: 0.86, 6: 0.95, 7: 1.0, 8: 1.1}
    padding = choose_padding(costs)
    assert [padded_rows(padding, t) for t in range(1, 10)] == [5, 5, 3, 4, 5, 6, 7, 8, 9]


def test_noise_does_not_turn_into_padding_and_one_row_is_always_padded():
    flat = {count: 1.0 + 0.01 * (count % 3) for count in range(2, MAX_PADDED_ROWS + 1)}  # within MIN_GAIN
    padding = choose_padding(flat)
    assert [padded_rows(padding, t) for t in range(1, 10)] == [2, 2, 3, 4, 5, 6, 7, 8, 9]
    assert padded_rows(DEFAULT_PADDING, 1) == 2 and padded_rows(DEFAULT_PADDING, 2) == 2


def test_a_burst_of_load_while_measuring_slows_every_count_alike():
    """Counts are timed in turns: a burst over the first third of the measurement (the machine busy with
    something else) leaves every median at its true cost, so no count looks cheaper than it is."""
    true_ms = {2: 1.0, 3: 1.02, 4: 1.01, 5: 1.03}
    clock = [0.0]
    calls_made = [0]
    repeats = 7
    burst_calls = repeats * len(true_ms) // 3

    def call_of(rows):
        def call():
            slow = 3.0 if calls_made[0] < burst_calls else 1.0
            clock[0] += true_ms[rows] * slow / 1e3
            calls_made[0] += 1
        return call

    medians = median_times_ms({rows: call_of(rows) for rows in true_ms}, repeats, clock=lambda: clock[0])
    assert medians == pytest.approx(true_ms)
    assert [padded_rows(choose_padding({**medians, 6: 1.1, 7: 1.1, 8: 1.1}), 1)] == [2]


def test_padding_needs_the_cost_of_two_rows():
    with pytest.raises(ValueError, match="cost of 2 rows"):
        choose_padding({3: 1.0, 4: 2.0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lone_row_through_any_padding_equals_the_same_row_inside_a_batch(dtype):
    from tandem.config import native_cpu_bf16
    from tandem.models.layers import RowStableLinear
    from tandem.models.packed import pack_linear_weights

    if dtype == torch.bfloat16 and not native_cpu_bf16():
        pytest.skip("bf16 is packed only on a CPU with native bf16 (avx512_bf16 or AMX)")
    torch.manual_seed(6)
    layer = RowStableLinear(1536, 1536, bias=True).to(dtype)  # Qwen2.5-1.5B's q projection
    tuner = PaddingTuner()
    assert pack_linear_weights(layer, tuner) == 1
    assert len(tuner.chosen) == 1 and padded_rows(layer.padding, 1) >= 2  # measured once, a lone row padded
    x = torch.randn(9, 1536).to(dtype)  # [9, in]
    with torch.inference_mode():
        in_batches = {rows: layer(x[:rows]) for rows in (2, 3, 5, 9)}  # the measured padding
        for pad_to in range(2, MAX_PADDED_ROWS + 1):  # every padding a measurement could choose
            layer.padding = (0, *[max(pad_to, t) for t in range(1, MAX_PADDED_ROWS + 1)])
            alone = layer(x[:1])  # [1, out]
            for rows, batch in in_batches.items():
                assert torch.equal(alone[0], batch[0]), (pad_to, rows)
            assert torch.equal(layer(x[:3]), in_batches[9][:3]), pad_to


def test_calls_above_32_rows_compute_one_of_16_sizes_per_octave_and_at_most_a_sixteenth_more():
    computed = [padded_rows(DEFAULT_PADDING, rows) for rows in range(1, 4097)]
    assert computed[:BUCKETED_FROM] == [2, *range(2, BUCKETED_FROM + 1)]  # small counts as they were
    assert all(rows <= size < rows * (1 + 1 / BUCKETS_PER_OCTAVE) for rows, size in enumerate(computed, 1)
               if rows > 1)  # a lone row computes two
    assert computed == sorted(computed)  # more rows never compute fewer
    for low in (32, 64, 128, 256, 512, 1024, 2048):  # each octave (low, 2 * low]: 16 sizes, its top one included
        sizes = {size for rows, size in enumerate(computed, 1) if low < rows <= 2 * low}
        assert len(sizes) == BUCKETS_PER_OCTAVE and max(sizes) == 2 * low, low
    assert len(set(computed)) == BUCKETED_FROM - 1 + 7 * BUCKETS_PER_OCTAVE  # 1..4,096 rows: 143 kernels, not 4,096


@pytest.mark.parametrize("rows", [33, 101, 700])
def test_a_bucketed_call_computes_its_bucket_and_returns_its_own_rows_bitwise(rows):
    from tandem.models.packed import pack_weight, packed_linear, packing_supported
    from tests.test_row_invariance import KernelRows

    if not packing_supported():
        pytest.skip("this PyTorch cannot pack weights for oneDNN")
    torch.manual_seed(rows)
    weight, bias = torch.randn(640, 576), torch.randn(640)  # fp32: packed on every CPU
    packed = pack_weight(weight)
    x = torch.randn(rows, 576)  # [rows, in]

    with torch.inference_mode(), KernelRows() as kernel:
        out = packed_linear(x, packed, bias)  # [rows, out]
    assert kernel.rows == [bucket_rows(rows)] and bucket_rows(rows) > rows
    with torch.inference_mode():
        exact = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # the old call: rows rows
    assert out.shape == (rows, 640) and torch.equal(out, exact)
