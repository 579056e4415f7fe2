"""Reading a checkpoint into our model (tandem/models/weights.py): fused parameters (q/k/v, gate/up) hold the
checkpoint's tensors row for row, converted once; a checkpoint that lacks a tensor or has one of another shape is
refused with an error naming it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.config import ModelConfig
from tandem.errors import ModelFileError
from tandem.models.weights import load_model


@pytest.fixture
def tiny_dir(tiny_qwen2_dir):
    return tiny_qwen2_dir


def load(model_dir, dtype=torch.float32):
    return load_model(model_dir, ModelConfig.from_dir(model_dir), dtype, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_parameters_hold_the_checkpoint_tensors_in_order(tiny_dir, dtype):
    saved = load_file(str(tiny_dir / "model.safetensors"))
    model = load(tiny_dir, dtype)
    params = dict(model.named_parameters())
    for i in range(2):
        prefix = f"model.layers.{i}."
        for ours, parts in (("self_attn.qkv_proj.weight", ("q_proj.weight", "k_proj.weight", "v_proj.weight")),
                            ("self_attn.qkv_proj.bias", ("q_proj.bias", "k_proj.bias", "v_proj.bias")),
                            ("mlp.gate_up_proj.weight", ("gate_proj.weight", "up_proj.weight"))):
            group = ours.split(".")[0]
            expected = torch.cat([saved[f"{prefix}{group}.{part}"] for part in parts]).to(dtype)
            assert params[f"layers.{i}.{ours}"].dtype == dtype
            assert torch.equal(params[f"layers.{i}.{ours}"], expected), ours


def test_a_missing_or_misshapen_tensor_is_refused_by_name(tiny_dir, tmp_path):
    saved = load_file(str(tiny_dir / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    key = "model.layers.1.self_attn.k_proj.weight"
    save_file({**saved, key: saved[key][:-1].clone()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelFileError, match=r"tensors for layers\.1\.self_attn\.qkv_proj\.weight have shapes"):
        load(tmp_path)
    save_file({k: v for k, v in saved.items() if k != key}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelFileError, match=rf"lacks tensor '{key}' \(needed for layers\.1\.self_attn\.qkv_proj"):
        load(tmp_path)
