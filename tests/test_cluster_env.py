"""The services `tandem up` starts share one machine's cores: their OpenMP threads must not spin (tandem.cluster)."""

from __future__ import annotations

import sys

from tandem import cluster as cluster_module
from tandem.cluster import ClusterSpec, LocalCluster


class RecordingPopen:
    """Stands in for subprocess.Popen: records the environment a service would start with, runs nothing."""

    envs: list[dict[str, str]] = []

    def __init__(self, cmd, stdout=None, stderr=None, text=None, start_new_session=None, env=None) -> None:
        RecordingPopen.envs.append(env)
        self.stdout = iter(())
        self.pid = 0


def launched_env(monkeypatch, tmp_path) -> dict[str, str]:
    RecordingPopen.envs = []
    monkeypatch.setattr(cluster_module.subprocess, "Popen", RecordingPopen)
    local = LocalCluster(ClusterSpec(target="tiny", log_dir=tmp_path))
    local._launch("target", "target-0", [sys.executable, "-c", "pass"])
    return RecordingPopen.envs[-1]


def test_services_start_with_passive_openmp_waits(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert launched_env(monkeypatch, tmp_path)["OMP_WAIT_POLICY"] == "PASSIVE"


def test_an_operators_wait_policy_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert launched_env(monkeypatch, tmp_path)["OMP_WAIT_POLICY"] == "ACTIVE"
