"""benchmarks/draft_sureness.py: what each answer position records, and its bins."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import draft_sureness


def test_a_position_records_the_drafts_top_probability_and_what_each_rule_keeps():
    same = torch.tensor([[2.0, 0.0, 0.0]])  # [1, 3]
    [row] = draft_sureness.position_rows(same, same.clone(), 0.7)
    assert row["greedy_kept"] and row["sampled_kept"] == pytest.approx(1.0)  # one distribution: always kept
    assert row["top"] == pytest.approx(math.exp(2) / (math.exp(2) + 2))
    target, draft = torch.tensor([[9.0, 0.0, 0.0]]), torch.tensor([[0.0, 9.0, 0.0]])
    [row] = draft_sureness.position_rows(target, draft, 1.0)
    assert not row["greedy_kept"] and row["sampled_kept"] < 0.01  # each sure of another token
    # sum of min(p, q): p = (0.5, 0.5), q = (1, 0) at T = 1 -> 0.5
    [row] = draft_sureness.position_rows(torch.tensor([[0.0, 0.0]]), torch.tensor([[50.0, 0.0]]), 1.0)
    assert row["sampled_kept"] == pytest.approx(0.5) and row["greedy_kept"]  # (argmax ties: the first, both sides)
    # a lean draft's smaller vocabulary: the target's mass beyond it is never matched
    [row] = draft_sureness.position_rows(torch.tensor([[0.0, 0.0, 0.0, 0.0]]), torch.tensor([[0.0, 0.0]]), 1.0)
    assert row["sampled_kept"] == pytest.approx(0.5)


def test_bins_count_every_position_once_and_average_within_each():
    rows = [{"top": 0.1, "greedy_kept": False, "sampled_kept": 0.2},
            {"top": 0.29, "greedy_kept": True, "sampled_kept": 0.4},
            {"top": 0.3, "greedy_kept": True, "sampled_kept": 0.6},
            {"top": 1.0, "greedy_kept": True, "sampled_kept": 1.0}]
    table = {b["draft top probability"]: b for b in draft_sureness.bins(rows)}
    assert sum(b["positions"] for b in table.values()) == 4
    assert table["0-0.3"]["greedy kept"] == 0.5 and table["0-0.3"]["sampled kept"] == pytest.approx(0.3)
    assert table["0.3-0.5"]["positions"] == 1 and table["0.95 and above"]["positions"] == 1
    assert table["0.5-0.7"]["greedy kept"] is None  # empty: no share to give


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf"])
def test_a_temperature_that_is_not_positive_and_finite_is_refused(bad):
    with pytest.raises(SystemExit, match="--temperature"):
        draft_sureness.check_args(draft_sureness.build_parser().parse_args(["--temperature", bad]))
