"""benchmarks/gpu_check.py in its CPU mode (tiny shapes): the GPU check cannot rot while no GPU is at hand."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_check

CHECKS = {"engine-vs-transformers", "speculative-greedy", "lossless", "processes", "tensor-parallel", "attention"}
MEASUREMENTS = {"forward-cost", "decode", "self-speculation"}


@pytest.mark.slow  # starts a target worker, a draft worker and a coordinator
def test_the_gpu_check_passes_on_cpu_with_tiny_shapes(tmp_path):
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["passed"] is True
    assert {c["check"] for c in report["checks"]} == CHECKS | {f"measure {m}" for m in MEASUREMENTS}
    assert set(report["measurements"]) == MEASUREMENTS
    assert list(report["measurements"]["forward-cost"]["tiny"]) == [str(n) for n in gpu_check.FORWARD_SIZES]
    tp = next(c for c in report["checks"] if c["check"] == "tensor-parallel")
    assert tp["backend"] == "gloo"
    assert "| engine-vs-transformers | tiny | True |" in (tmp_path / "gpu_check.md").read_text()


def test_a_failed_check_is_reported_and_fails_the_run(tmp_path, monkeypatch):
    def broken(*args):
        raise AssertionError("logits differ")

    monkeypatch.setattr(gpu_check, "attention", broken)
    skip = ",".join((CHECKS | MEASUREMENTS) - {"attention"})
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--skip", skip]) == 1
    (check,) = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    assert check["check"] == "attention" and check["passed"] is False and "logits differ" in check["error"]


def test_cuda_without_a_gpu_says_how_to_run_on_cpu(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cuda"])
    assert "--device cpu" in capsys.readouterr().err
