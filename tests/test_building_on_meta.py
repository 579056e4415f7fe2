"""Loading a model builds its skeleton on the meta device without computing on it (``building_on_meta``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

LOAD = """
import sys
from tandem.config import EngineConfig
from tandem.engine import ModelEngine
engine = ModelEngine.load(EngineConfig(sys.argv[1], dtype="float32", kv_cache_tokens=64, block_size=4))
assert engine.model.embed_tokens.weight.device.type == "cpu" and not engine.model.rotary.inv_freq.is_meta
print("dynamo imported" if "torch._dynamo" in sys.modules else "no dynamo")
"""


@pytest.mark.slow  # a process of its own: not the unit tier
def test_loading_a_model_does_not_import_torch_dynamo(tiny_llama_dir) -> None:
    """An operation on a meta tensor runs torch's Python reference kernel, whose first call imports torch._dynamo:
    1.3 s of every worker's start-up. In a fresh process, since pytest's may have imported it already."""
    done = subprocess.run([sys.executable, "-c", LOAD, str(tiny_llama_dir)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no dynamo"


def test_a_row_stable_linear_off_the_meta_device_is_still_initialised() -> None:
    import torch

    from tandem.models.layers import RowStableLinear

    torch.manual_seed(0)
    layer = RowStableLinear(16, 8)
    assert layer.weight.abs().sum() > 0 and layer.bias.abs().sum() > 0
    with torch.device("meta"):
        skeleton = RowStableLinear(16, 8)
    assert skeleton.weight.is_meta
