"""`--train-dtype auto` on a CPU: both modes timed, the faster kept, and the timing leaves no trace."""

from __future__ import annotations

import torch

from tandem.heads.train import compute_dtype
from tandem.heads.train.compute_dtype import choose_compute_dtype
from tandem.heads.train.shards import Batch

VOCAB, HIDDEN = 11, 8


class LinearObjective:
    """A head as small as can be: logits from a feature by one linear map, labels as given."""

    def __init__(self, module: torch.nn.Linear) -> None:
        self.module = module
        self.names = ["step 1"]

    def predictions(self, batch: Batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rows = batch.features.reshape(-1, HIDDEN).float()  # [B * N, F]
        return [(self.module(rows).float(), batch.labels.reshape(-1))]


def _batch() -> Batch:
    generator = torch.Generator().manual_seed(0)
    return Batch(
        tokens=torch.randint(0, VOCAB, (2, 5), generator=generator),
        labels=torch.randint(0, VOCAB, (2, 5), generator=generator),
        features=torch.randn(2, 5, HIDDEN, generator=generator).bfloat16(),
        lengths=torch.tensor([5, 5]),
    )


def test_explicit_dtype_is_taken_without_timing(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("an explicit --train-dtype must not be timed")

    monkeypatch.setattr(compute_dtype, "_time_step", refuse)
    module = torch.nn.Linear(HIDDEN, VOCAB)
    objective = LinearObjective(module)
    cpu = torch.device("cpu")
    assert choose_compute_dtype("bfloat16", cpu, module, objective, _batch()).use_bf16
    assert not choose_compute_dtype("float32", cpu, module, objective, _batch()).use_bf16


def test_auto_keeps_the_faster_mode(monkeypatch) -> None:
    module = torch.nn.Linear(HIDDEN, VOCAB)
    objective = LinearObjective(module)
    for bf16_seconds, expect_bf16 in ((0.5, True), (2.0, False)):
        monkeypatch.setattr(compute_dtype, "_time_step",
                            lambda module, objective, batch, device, use_bf16, s=bf16_seconds: s if use_bf16 else 1.0)
        choice = choose_compute_dtype("auto", torch.device("cpu"), module, objective, _batch())
        assert choice.use_bf16 is expect_bf16
        assert choice.seconds == {"float32": 1.0, "bfloat16": bf16_seconds}
        assert "fp32 1.00 s" in choice.reason


def test_timing_changes_no_weight_and_leaves_no_gradient() -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(HIDDEN, VOCAB)
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    choice = choose_compute_dtype("auto", torch.device("cpu"), module, LinearObjective(module), _batch())
    assert set(choice.seconds or {}) == {"float32", "bfloat16"}
    assert all(seconds > 0 for seconds in (choice.seconds or {}).values())
    for name, p in module.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.grad is None, name
