"""Configuration errors name what was wrong and what is accepted."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig, ModelConfig, available_device
from tandem.errors import InvalidRequestError, UnsupportedArchitectureError


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM, Qwen2ForCausalLM") as info:
        ModelConfig.from_hf_dict({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    assert "GPT2LMHeadModel" in str(info.value)


def test_unsupported_rope_type_is_named():
    cfg = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "rope_parameters": {"rope_type": "yarn"}}
    with pytest.raises(UnsupportedArchitectureError, match="yarn"):
        ModelConfig.from_hf_dict(cfg)


def test_qwen2_always_has_attention_bias_and_rope_theta_is_read_from_v5_layout():
    cfg = {"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "eos_token_id": [3, 4]}
    model = ModelConfig.from_hf_dict(cfg)
    assert model.attention_bias and model.rope_theta == 1e6 and model.eos_token_ids == (3, 4)
    assert model.head_dim == 4


@pytest.mark.parametrize("kwargs,message", [
    ({"dtype": "int8"}, "dtype must be"),
    ({"attention_backend": "magic"}, "attention backend"),
    ({"block_size": 12}, "power of two"),
    ({"kv_cache_tokens": 4}, "at least one block"),
    ({"dtype": "float16"}, "float16 is for GPUs"),
    ({"device": "gpu"}, "device must be cpu, cuda or cuda:N, got 'gpu'"),  # was torch's RuntimeError, a traceback
    ({"device": "mps"}, "device must be cpu, cuda or cuda:N, got 'mps'"),
])
def test_engine_config_validation(tmp_path, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        EngineConfig(tmp_path, **kwargs)


def test_missing_config_json_is_named(tmp_path):
    with pytest.raises(InvalidRequestError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize(("dtype", "chosen"), [("float32", "none"), ("bfloat16", "int8")])
def test_a_draft_quantized_auto_is_int8_except_in_float32(tmp_path, dtype, chosen):
    # fp32 has no fast int8 kernel: a lean fp32 draft step cost more than the target's (spec_bench).
    assert EngineConfig(tmp_path, dtype=dtype, quantization="auto").quantization == chosen
    assert EngineConfig(tmp_path, dtype=dtype).quantization == "none"  # targets are never quantized


def test_a_draft_quantized_auto_on_cuda_stays_in_its_dtype(tmp_path, monkeypatch):
    """torch's CUDA kernel for int8 weights is a thread per output element; bf16 goes to cuBLAS."""
    import torch

    from tandem import config

    monkeypatch.setattr(config, "available_device", lambda text, flag="device": torch.device(text))
    draft = EngineConfig(tmp_path, device="cuda", quantization="auto")
    assert draft.resolved_dtype in (torch.bfloat16, torch.float16) and draft.quantization == "none"
    assert EngineConfig(tmp_path, device="cuda", quantization="int8").quantization == "int8"  # asked for: kept


def test_dtype_auto_is_bf16_only_where_the_cpu_multiplies_it_and_a_draft_left_to_choose_runs_lean(tmp_path,
                                                                                                    monkeypatch):
    import torch

    from tandem import config

    for native, runs in ((True, True), (False, True), (False, False)):
        monkeypatch.setattr(config, "native_cpu_bf16", lambda native=native: native)
        monkeypatch.setattr(config, "cpu_runs_bf16", lambda runs=runs: runs)
        target = EngineConfig(tmp_path)
        assert target.resolved_dtype == (torch.bfloat16 if native else torch.float32)
        assert target.pack_weights  # fp32, or bf16 multiplied natively: packed for oneDNN
        draft = EngineConfig(tmp_path, quantization="auto")
        assert (draft.resolved_dtype, draft.quantization) == ((torch.bfloat16, "int8") if runs else
                                                              (torch.float32, "none"))
        pinned = EngineConfig(tmp_path, dtype="float32", quantization="auto")  # a dtype asked for is kept
        assert (pinned.resolved_dtype, pinned.quantization) == (torch.float32, "none")


def test_draft_flags_carry_the_drafts_own_dtype_to_engines_and_to_spawned_workers():
    import argparse

    from tandem.cli.draft_flags import add_draft_flags, draft_engine_options, draft_worker_args

    parser = argparse.ArgumentParser()
    add_draft_flags(parser)
    args = parser.parse_args(["--draft-dtype", "float32", "--draft-vocab", "0"])
    assert draft_engine_options(args) == {"quantization": "auto", "vocab_limit": None, "dtype": "float32"}
    assert draft_worker_args(args)[-2:] == ["--dtype", "float32"]  # after the workers' common --dtype: it wins
    serve = argparse.ArgumentParser()
    add_draft_flags(serve, prefix="--")  # `serve draft`: its own --dtype is the worker's
    assert "dtype" not in draft_engine_options(serve.parse_args([]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where no CUDA device is")
def test_a_cuda_device_where_there_is_none_is_named_with_the_flag_that_asked():
    with pytest.raises(InvalidRequestError, match=r"--device cuda:1 was asked for but CUDA is not available here"):
        available_device("cuda:1", "--device")
    assert available_device("cpu") == torch.device("cpu")
