"""``--gpu-memory-utilization``: the KV pool sized from the device's memory (tandem/kv_sizing.py).

The memory figures are the one thing faked (no GPU here): the profiling forward, the pool and the engine are real."""

from __future__ import annotations

import pytest

from tandem.config import EngineConfig
from tandem.engine import ModelEngine
from tandem.errors import InvalidRequestError
from tandem.kv_sizing import GIB, HEADROOM_BYTES, DeviceMemory, kv_bytes_per_token, size_pool

MIB = 1 << 20


def test_the_pool_takes_what_the_fraction_leaves_in_whole_blocks():
    budget = size_pool(0.5, total=16 * GIB, in_use=3 * GIB, activation_peak=512 * MIB, bytes_per_token=28 * 1024,
                       block_size=16)
    room = 8 * GIB - 3 * GIB - 512 * MIB - HEADROOM_BYTES
    assert budget.tokens == room // (28 * 1024) // 16 * 16
    assert budget.tokens % 16 == 0 and budget.tokens * 28 * 1024 <= room < (budget.tokens + 16) * 28 * 1024
    assert "from 0.5 of the device's 16.0 GiB" in budget.describe()


def test_a_fraction_that_leaves_no_block_names_every_figure():
    with pytest.raises(InvalidRequestError) as caught:
        size_pool(0.3, total=16 * GIB, in_use=4 * GIB, activation_peak=GIB, bytes_per_token=1024, block_size=16)
    message = str(caught.value)
    for figure in ("0.3 of the device's 16.0 GiB is 4.8 GiB", "4.0 GiB are in use", "1.00 GiB go to activations",
                   "1.0 GiB are kept free", "give --kv-cache-tokens"):
        assert figure in message


def test_bytes_per_token_are_what_the_pool_allocates_per_token(tiny_qwen2_dir):
    engine = ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype="float32", kv_cache_tokens=256, block_size=16))
    cache = engine.kv_cache
    allocated = (cache.key.numel() + cache.value.numel()) * cache.key.element_size()
    assert kv_bytes_per_token(engine.model) * 256 == allocated


def test_a_worker_sized_by_memory_profiles_a_real_forward_and_gets_the_pool_left(tiny_qwen2_dir):
    cfg = EngineConfig(tiny_qwen2_dir, dtype="float32", block_size=16)
    cfg.gpu_memory_utilization = 0.5  # (validated only on CUDA, which this machine lacks: set past the check)
    forwards = []

    def profile(forward):
        forward()  # the real forward of the model, on a scratch pool
        forwards.append(True)
        return 300 * MIB

    memory = DeviceMemory(total=lambda: 8 * GIB, free=lambda: 6 * GIB, profile=profile)
    engine = ModelEngine.load(cfg, memory=memory)
    expected = size_pool(0.5, 8 * GIB, 2 * GIB, 300 * MIB, kv_bytes_per_token(engine.model), 16).tokens
    assert forwards == [True]
    assert engine.kv_cache.num_blocks * 16 == expected > cfg.kv_cache_tokens  # not the fixed pool
    assert engine.kv_budget.tokens == expected and engine.kv_budget.activation_peak == 300 * MIB
    assert ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype="float32")).kv_budget is None  # a fixed pool


@pytest.mark.parametrize("kwargs,message", [
    ({"gpu_memory_utilization": 0.9}, "sizes the KV pool from a GPU's memory, and this worker runs on cpu"),
    ({"gpu_memory_utilization": 0.0}, "must be a fraction in (0, 1], got 0.0"),
    ({"gpu_memory_utilization": 1.5}, "must be a fraction in (0, 1], got 1.5"),
    ({"gpu_memory_utilization": float("nan")}, "must be a fraction in (0, 1], got nan"),
])
def test_a_fraction_is_refused_where_it_cannot_size_a_pool(tiny_qwen2_dir, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(tiny_qwen2_dir, **kwargs)


def test_serve_refuses_both_ways_of_sizing_the_pool(tiny_qwen2_dir, capsys):
    from tandem.cli import main

    code = main(["serve", "target", "--model", str(tiny_qwen2_dir), "--kv-cache-tokens", "4096",
                 "--gpu-memory-utilization", "0.9"])
    assert code == 2
    assert "--kv-cache-tokens and --gpu-memory-utilization both size the KV pool: give one" in capsys.readouterr().err
