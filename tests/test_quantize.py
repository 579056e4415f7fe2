"""Lean drafts: int8 linears and a cut vocabulary keep the model's function, and never touch a target."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine import ForwardItem, ModelEngine
from tandem.errors import InvalidRequestError
from tandem.models.quantize import Int8Linear


def test_int8_linear_is_exact_on_representable_weights():
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (48, 32), dtype=torch.int8)
    q[:, 0] = 127  # each row's largest magnitude maps to 127, so its grid is exactly `scales`
    scales = torch.rand(48) + 0.5
    weight = q.float() * scales[:, None]
    layer = Int8Linear.from_weight(weight, bias=torch.randn(48))
    x = torch.randn(5, 32)
    expected = torch.nn.functional.linear(x, weight, layer.bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)


def test_int8_linear_error_is_within_half_a_step_per_weight():
    torch.manual_seed(1)
    weight, x = torch.randn(64, 128), torch.randn(3, 128)
    layer = Int8Linear.from_weight(weight)
    step = weight.abs().amax(dim=1) / 127  # [64]
    bound = 0.5 * x.abs().sum(dim=1, keepdim=True) * step[None, :] + 1e-4  # [3, 64]
    error = (layer(x) - x @ weight.T).abs()
    assert (error <= bound).all()
    assert error.max() > 0  # it did quantize


def load(model_dir, **options) -> ModelEngine:
    return ModelEngine.load(EngineConfig(model_dir, dtype="float32", kv_cache_tokens=1024, block_size=4, **options))


def test_cut_vocabulary_scores_only_the_first_ids(tiny_qwen2_dir):
    full, cut = load(tiny_qwen2_dir), load(tiny_qwen2_dir, vocab_limit=40)
    prompt = [ForwardItem("s", [5, 17, 33, 8], num_logits=4)]
    full_logits, cut_logits = full.forward(prompt)[0], cut.forward(prompt)[0]  # [4, 97] each
    assert cut_logits.shape == full_logits.shape
    torch.testing.assert_close(cut_logits[:, :40], full_logits[:, :40])
    assert torch.isneginf(cut_logits[:, 40:]).all()
    assert torch.softmax(cut_logits, -1)[:, 40:].sum() == 0


def test_int8_draft_tracks_its_full_precision_model(tiny_qwen2_dir):
    full, lean = load(tiny_qwen2_dir), load(tiny_qwen2_dir, quantization="int8")
    assert any(isinstance(m, Int8Linear) for m in lean.model.modules())
    prompt = [ForwardItem("s", list(range(3, 40)), num_logits=37)]
    a, b = full.forward(prompt)[0], lean.forward(prompt)[0]  # [37, 97]
    assert not torch.equal(a, b)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("options,field", [
    ({"quantization": "int4"}, "quantization"),
    ({"vocab_limit": 0}, "vocab limit"),
])
def test_bad_draft_options_are_named(tiny_qwen2_dir, options, field):
    with pytest.raises(InvalidRequestError, match=field):
        EngineConfig(tiny_qwen2_dir, **options)


def test_the_int8_kernel_keeps_the_inputs_it_is_measured_faster_on(monkeypatch):
    """fp32: above 16 rows a dequantized weight (MKL); bf16 with native bf16: above 64 (dequantizing costs a
    pass ~100 ms there); emulated bf16: never (the int8 kernel wins at every size measured)."""
    import tandem.models.quantize as quantize

    dense = quantize._dense_beats_int8
    assert not dense(torch.float32, 16) and dense(torch.float32, 17)
    monkeypatch.setattr(quantize, "_NATIVE_BF16", True)
    assert not dense(torch.bfloat16, 64) and dense(torch.bfloat16, 65)
    monkeypatch.setattr(quantize, "_NATIVE_BF16", False)
    assert not dense(torch.bfloat16, 4096)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_sized_inputs_use_the_int8_weights_too(dtype):
    """Long inputs may take a faster kernel (see Int8Linear), never a different weight."""
    from tandem.models.quantize import INT8_MAX_ROWS, INT8_MAX_ROWS_NATIVE_BF16

    torch.manual_seed(2)
    weight = torch.randn(32, 16)
    layer = Int8Linear.from_weight(weight.to(dtype), bias=torch.randn(32).to(dtype))
    long_x = torch.randn(3 * INT8_MAX_ROWS_NATIVE_BF16, 16).to(dtype)  # past every crossover
    in_short_calls = torch.cat([layer(part) for part in long_x.split(INT8_MAX_ROWS)])  # int8 kernel only
    on_dequantized = torch.nn.functional.linear(long_x, layer.dequantized(dtype), layer.bias)
    # bf16: the dequantized weight itself is rounded to bf16 (2^-9 relative), over 16 inputs of size ~1.
    tolerance = {torch.float32: {"rtol": 0, "atol": 1e-4}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 0.1}}[dtype]
    torch.testing.assert_close(layer(long_x), in_short_calls, **tolerance)
    torch.testing.assert_close(layer(long_x), on_dequantized, **tolerance)
    dense = torch.nn.functional.linear(long_x, weight.to(dtype), layer.bias)
    assert not torch.equal(layer(long_x), dense)  # the int8 grid, not the dense weight


def test_lean_draft_holds_no_dense_copy_of_its_layers(tiny_qwen2_dir):
    lean = load(tiny_qwen2_dir, quantization="int8")
    int8_layers = [m for m in lean.model.modules() if isinstance(m, Int8Linear)]
    assert len(int8_layers) == 4 * lean.config.num_layers + 1
    for m in int8_layers:  # every tensor it holds is a registered one: no unregistered dense copy
        assert not [k for k, v in vars(m).items() if isinstance(v, torch.Tensor)]
    layer_matrices = [n for n, t in lean.model.layers.state_dict().items() if t.dim() == 2 and t.is_floating_point()]
    assert layer_matrices == []
