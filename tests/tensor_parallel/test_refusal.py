"""A model that does not split over N ranks is refused at start, with a message that says why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tandem.config import EngineConfig, ModelConfig
from tandem.errors import InvalidRequestError
from tandem.models.tensor_parallel import check_splittable

REPO_ROOT = Path(__file__).resolve().parents[2]


def smollm2_shape() -> ModelConfig:
    """SmolLM2-135M's architecture: 9 heads, 3 KV heads."""
    return ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                       num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                       max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False)


def test_smollm2_does_not_split_over_two_ranks() -> None:
    with pytest.raises(InvalidRequestError) as refused:
        check_splittable(smollm2_shape(), 2)
    message = str(refused.value)
    assert "cannot split this model over 2 tensor-parallel ranks" in message
    assert "attention heads (9) and KV heads (3) are not divisible by 2" in message


def test_smollm2_splits_over_three_ranks() -> None:
    check_splittable(smollm2_shape(), 3)


def test_engine_config_refuses_tensor_parallel_drafts(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="tensor parallelism is for targets"):
        EngineConfig(tmp_path, tensor_parallel_size=2, quantization="int8")
    with pytest.raises(InvalidRequestError, match="at least 1"):
        EngineConfig(tmp_path, tensor_parallel_size=0)


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan")])
def test_engine_config_refuses_a_rank_timeout_that_is_not_positive(tmp_path: Path, seconds: float) -> None:
    with pytest.raises(InvalidRequestError, match=f"rank timeout must be a positive number of seconds, got {seconds}"):
        EngineConfig(tmp_path, tensor_parallel_size=2, rank_timeout_s=seconds)


def test_serve_target_refuses_before_starting_any_rank(tmp_path: Path) -> None:
    from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

    model_dir = save_tiny_model(tmp_path / "m", "llama", num_attention_heads=6, num_key_value_heads=3,
                                hidden_size=96)
    save_tiny_tokenizer(model_dir, 97)
    done = subprocess.run(
        [sys.executable, "-m", "tandem", "serve", "target", "--model", str(model_dir), "--port", "0",
         "--tensor-parallel-size", "2", "--dtype", "float32"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0
    assert "KV heads (3) is not divisible by 2" in done.stderr
    assert "TANDEM_RANKS" not in done.stdout  # refused before any rank was started
