"""N ranks (gloo, real spawned processes) give the single-rank model's logits and greedy tokens, fp32.

Each N-rank run is a process of its own acting as rank 0 (``scenario.run``): it starts
ranks 1..N-1 exactly as a target worker does and drives them through the engine.
Tolerance: 1e-4 absolute on logits of magnitude about 5 (measured differences are
below 5e-6): the all-reduce adds the ranks' partial sums in another order than one
matmul does, which fp32 rounds differently.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from tests.tensor_parallel import scenario
from tests.tiny_models import save_tiny_model

pytestmark = pytest.mark.alone  # ranks in lockstep: `make test` runs them after the rest, alone

ATOL = 1e-4
RUN_TIMEOUT_S = 180


def run_ranks(model_dir: Path, ranks: int, out: Path, dtype: str = "float32", timeout_s: float = RUN_TIMEOUT_S,
              **options) -> dict:
    """``scenario.run`` as rank 0 of ``ranks``, in a process of its own (spawned, as the worker spawns its ranks)."""
    process = multiprocessing.get_context("spawn").Process(
        target=scenario.run, args=(model_dir, ranks, dtype, out), kwargs=options
    )
    process.start()
    process.join(timeout_s)
    if process.is_alive():
        process.kill()
        pytest.fail(f"{ranks} ranks did not finish the scenario in {timeout_s:.0f}s")
    assert process.exitcode == 0, f"rank 0 exited with code {process.exitcode}"
    return torch.load(out)


@pytest.fixture(scope="module", params=[("llama", 2), ("qwen2", 2), ("llama", 3)], ids=lambda p: f"{p[0]}-{p[1]}ranks")
def one_and_many(request, tmp_path_factory) -> tuple[dict, dict]:
    family, ranks = request.param
    tmp = tmp_path_factory.mktemp(f"tp-{family}-{ranks}")
    # 6 heads and 3 KV heads split over 3 ranks; the vocabulary (97) over neither 2 nor 3 (uneven lm_head slices).
    shapes = dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=192) \
        if ranks == 3 else {}
    model_dir = save_tiny_model(tmp / "model", family, seed=4, **shapes)
    scenario.run(model_dir, 1, "float32", tmp / "one.pt")
    return torch.load(tmp / "one.pt"), run_ranks(model_dir, ranks, tmp / "many.pt")


@pytest.mark.parametrize("phase", ["prefill", "decode", "verify", "after_rollback", "tree", "after_keep_path"])
def test_logits_equal_one_rank(one_and_many, phase: str) -> None:
    one, many = one_and_many
    assert many[phase].shape == one[phase].shape
    torch.testing.assert_close(many[phase], one[phase], rtol=0, atol=ATOL)


def test_greedy_tokens_identical(one_and_many) -> None:
    one, many = one_and_many
    assert many["greedy"] == one["greedy"]


def test_a_prompts_own_scores_equal_one_rank(one_and_many) -> None:
    one, many = one_and_many
    assert len(one["prompt_scores"]) == len(scenario.PROMPT_A) - 1
    torch.testing.assert_close(many["prompt_scores"], one["prompt_scores"], rtol=0, atol=ATOL)
    assert many["prompt_top_ids"] == one["prompt_top_ids"]


def test_rollback_is_exact_on_every_rank(one_and_many) -> None:
    """After rolling back rejected tokens, the sequence continues as one that never saw them."""
    _, many = one_and_many
    torch.testing.assert_close(many["after_rollback"], many["fresh"], rtol=0, atol=ATOL)


def test_keep_path_moves_the_kv_on_every_rank(one_and_many) -> None:
    """After keeping a tree path whose rows moved, the sequence continues as one fed just that path:
    a rank that skipped the move would hold another branch's K/V for its heads."""
    one, many = one_and_many
    torch.testing.assert_close(one["after_keep_path"], one["chain_of_path"], rtol=0, atol=ATOL)
    torch.testing.assert_close(many["after_keep_path"], many["chain_of_path"], rtol=0, atol=ATOL)
