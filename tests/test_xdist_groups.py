"""`make test`'s scheduling (tests/xdist_groups.py): a group's tests all run on one xdist worker.

xdist's own loadgroup silently stopped grouping under pytest 9.2; this runs a small suite of its own
through real xdist workers so that ours cannot stop without a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts pytest processes: not the unit tier

REPO_ROOT = Path(__file__).resolve().parents[1]

SUITE = '''
import json, os
from pathlib import Path
import pytest

OUT = Path(os.environ["GROUPS_OUT"])


def record(name):
    with OUT.open("a") as out:
        out.write(json.dumps([name, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")


@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    record(f"grouped-{i}")


@pytest.mark.parametrize("i", range(12))
def test_free(i):
    record(f"free-{i}")
'''

CONFTEST = '''
def pytest_configure(config):
    from tests.xdist_groups import register
    register(config)
'''


def run_suite(tmp_path: Path, dist: str) -> dict[str, str]:
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    out = tmp_path / "ran.jsonl"
    env = {**os.environ, "GROUPS_OUT": str(out), "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", dist, "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(json.loads(line) for line in out.read_text().splitlines())


def test_a_groups_tests_run_on_one_worker_and_every_test_runs_once(tmp_path: Path) -> None:
    ran = run_suite(tmp_path, "loadgroup")
    assert sorted(ran) == sorted([f"grouped-{i}" for i in range(6)] + [f"free-{i}" for i in range(12)])
    assert len({worker for name, worker in ran.items() if name.startswith("grouped")}) == 1, ran


def test_other_dist_modes_are_left_to_xdist(tmp_path: Path) -> None:
    """Under --dist load the plugin stays out: nothing is grouped, every test still runs."""
    ran = run_suite(tmp_path, "load")
    assert len(ran) == 18
