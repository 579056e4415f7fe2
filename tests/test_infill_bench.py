"""benchmarks/infill_bench.py: its HumanEval infilling tasks, its test runner, and a whole run on the tiny model
with fill-in-the-middle markers (so the script cannot rot while nobody times it)."""

from __future__ import annotations

import gzip
import json

from benchmarks import infill_bench
from benchmarks.common import humaneval_path


def test_each_task_is_its_problem_with_the_middle_third_of_the_solution_cut_out():
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        rows = {row["task_id"]: row for row in map(json.loads, f)}
    tasks = infill_bench.infill_tasks(6)
    assert len(tasks) == 6
    for task in tasks:
        row = rows[task.task_id]
        assert task.prefix + task.middle + task.suffix == row["prompt"] + row["canonical_solution"]
        assert task.prefix.startswith(row["prompt"]) and task.middle.strip() and task.suffix.strip()
        assert task.middle.endswith("\n")  # whole lines cut


def test_the_cut_lines_pass_the_problems_tests_and_other_lines_do_not(monkeypatch):
    task = infill_bench.infill_tasks(1)[0]
    assert infill_bench.passes(task, task.middle)
    assert not infill_bench.passes(task, "")
    monkeypatch.setattr(infill_bench, "TEST_TIMEOUT_S", 0.5)
    indent = task.middle[: len(task.middle) - len(task.middle.lstrip())]
    assert not infill_bench.passes(task, f"{indent}while True:\n{indent}    pass\n")  # a hang is a failure


def test_a_run_on_the_tiny_model_writes_its_tables_and_every_answer_is_target_onlys(tmp_path, capsys):
    from tests.tiny_models import save_tiny_served_model

    model = save_tiny_served_model(tmp_path / "model", fim=True)
    assert infill_bench.main(["--target", str(model), "--methods", "ngram", "--limit", "2", "--max-new-tokens", "8",
                              "--dtype", "float32", "--no-execute", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "infill_bench.json").read_text())
    assert [s["method"] for s in result["summary"]] == ["target-only", "ngram"]
    assert all(s["same_as_target_only"] == s["tasks"] == 2 for s in result["summary"])
    assert len(result["quality"]) == 2 and all(q["passes"] is None for q in result["quality"])
    assert (tmp_path / "infill_bench.md").is_file() and (tmp_path / "infill_bench.png").is_file()
