"""A packed call never computes more rows than its kernels were probed row-invariant at (row_invariance.py).

Found on an Intel Xeon with AMX: oneDNN's bf16 calls of more than 32 rows round about one output in 10,000
otherwise than calls of up to 32, so a prompt's rows differed from the same tokens decoded. The kernels here are
stand-ins with that property (the real ones vary only on such a CPU); the real kernels are checked on every
machine by tests/test_engine_rollback_and_batching.py and tests/test_rows_by_position.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.models.row_invariance import LIMITS, MIN_CALL_LIMIT, probe_call_limit


def kernel(weight: torch.Tensor, varies_above: int | None):
    """x [T, in] -> [T, out] in bf16: each row summed alone in float64 (row-invariant), except that calls of more
    than ``varies_above`` rows sum in float32 in another order, which flips a last bit here and there, as a
    kernel with other blocking does."""

    def call(x: torch.Tensor) -> torch.Tensor:
        if varies_above is not None and x.shape[0] > varies_above:
            return (x.float().flip(1) @ weight.float().flip(1).T).to(torch.bfloat16)
        return (x.double() @ weight.double().T).to(torch.bfloat16)

    return call


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(576, 1536, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)  # [out, in]


@pytest.mark.parametrize("varies_above,limit", [(None, LIMITS[-1]), (32, 32), (64, 64), (40, 32), (20, 16), (5, 2)])
def test_the_limit_is_the_largest_power_of_two_up_to_which_every_count_agreed(weight, varies_above, limit):
    assert probe_call_limit(kernel(weight, varies_above), 1536, torch.bfloat16) == limit


def test_a_kernel_that_rounds_otherwise_is_seen_though_few_outputs_differ(weight):
    """The stand-in above 32 rows flips few outputs (as the real one: 1 in a 34-row call of this shape), so one
    call at a count would miss it: every count is compared over many rows."""
    x = torch.randn(34, 1536, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    steady, other = kernel(weight, None)(x), kernel(weight, 32)(x)
    assert 0 < (steady != other).sum().item() < steady.numel() // 100
    assert probe_call_limit(kernel(weight, 32), 1536, torch.bfloat16) == 32


class KernelRows(TorchDispatchMode):
    """The row count of every oneDNN linear call made under it."""

    def __init__(self):
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.mkldnn._linear_pointwise:
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows,calls", [(82, [32, 32, 18]), (32, [32]), (65, [32, 32, 2])])
def test_a_call_over_the_limit_is_computed_in_calls_of_at_most_the_limit(rows, calls):
    from tandem.models.packed import pack_weight, packed_linear, packing_supported

    if not packing_supported():
        pytest.skip("this PyTorch cannot pack weights for oneDNN")
    generator = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(640, 576, generator=generator), torch.randn(640, generator=generator)
    packed = pack_weight(weight)  # fp32: packed on every CPU
    x = torch.randn(rows, 576, generator=generator)  # [rows, in]
    with torch.inference_mode(), KernelRows() as kernel_rows:
        out = packed_linear(x, packed, bias, max_rows=32)  # [rows, out]
    assert kernel_rows.rows == calls
    with torch.inference_mode():
        pieces = torch.cat([packed_linear(piece, packed, bias) for piece in x.split(32)])
    assert torch.equal(out, pieces)


def test_layers_take_the_probed_limit_and_a_shape_that_varies_below_the_minimum_stays_dense(monkeypatch, caplog):
    from tandem.models import packed as packed_module
    from tandem.models import row_padding
    from tandem.models.layers import RowStableLinear

    if not packed_module.packing_supported():
        pytest.skip("this PyTorch cannot pack weights for oneDNN")
    probed: list[tuple[int, int]] = []

    def probe(call, in_features, dtype):
        out_features = call(torch.zeros(2, in_features, dtype=dtype)).shape[1]
        probed.append((out_features, in_features))
        return 32 if out_features == 1024 else MIN_CALL_LIMIT // 2

    monkeypatch.setattr(row_padding, "kernels_vary_by_rows", lambda dtype: True)
    monkeypatch.setattr(row_padding, "probe_call_limit", probe)
    model = torch.nn.Sequential(RowStableLinear(576, 1024), RowStableLinear(576, 768), RowStableLinear(576, 1024),
                                RowStableLinear(576, 768))
    with caplog.at_level("WARNING", logger="tandem.models.packed"):
        assert packed_module.pack_linear_weights(model) == 2
    assert [model[i].max_call_rows for i in (0, 2)] == [32, 32]
    assert all(model[i].packed_weight is None and model[i].weight is not None for i in (1, 3))  # left dense
    assert probed == [(1024, 576), (768, 576)]  # once per shape
    assert [r.getMessage() for r in caplog.records] == [  # once per shape, naming it
        "768x576 float32 linear layers stay unpacked: oneDNN's kernels for them compute a row differently in "
        "calls of more than 8 rows"]
    x = torch.randn(70, 576)
    with torch.inference_mode(), KernelRows() as kernel_rows:
        model[0](x)
    assert kernel_rows.rows == [32, 32, 6]


def test_no_probe_and_no_split_where_kernels_do_not_vary_by_rows(monkeypatch):
    from tandem.models import packed as packed_module
    from tandem.models import row_padding
    from tandem.models.layers import RowStableLinear

    if not packed_module.packing_supported():
        pytest.skip("this PyTorch cannot pack weights for oneDNN")
    monkeypatch.setattr(row_padding, "kernels_vary_by_rows", lambda dtype: False)
    monkeypatch.setattr(row_padding, "probe_call_limit", lambda *args: pytest.fail("probed"))
    layer = RowStableLinear(576, 1024)
    assert packed_module.pack_linear_weights(torch.nn.Sequential(layer)) == 1
    assert layer.max_call_rows is None
