"""The services `tandem up` starts share one machine's cores (tandem.cluster): their OpenMP threads spin only
briefly, and workers come up one at a time (tandem.rpc.startup_lock)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from tandem import cluster as cluster_module
from tandem.cluster import CO_LOCATED_SPIN_COUNT, ClusterSpec, LocalCluster
from tandem.errors import TandemError
from tandem.rpc.startup_lock import StartupLock


class RecordingPopen:
    """Stands in for subprocess.Popen: records the command and environment a service would start with."""

    launched: list[tuple[list[str], dict[str, str]]] = []

    def __init__(self, cmd, stdout=None, stderr=None, text=None, start_new_session=None, env=None) -> None:
        RecordingPopen.launched.append((cmd, env))
        self.stdout = iter(())
        self.pid = 0


def recording_cluster(monkeypatch, tmp_path) -> LocalCluster:
    RecordingPopen.launched = []
    monkeypatch.setattr(cluster_module.subprocess, "Popen", RecordingPopen)
    return LocalCluster(ClusterSpec(target="tiny", draft="tiny", log_dir=tmp_path))


def launched_env(monkeypatch, tmp_path) -> dict[str, str]:
    recording_cluster(monkeypatch, tmp_path)._launch("target", "target-0", [sys.executable, "-c", "pass"])
    return RecordingPopen.launched[-1][1]


def test_services_spin_briefly_between_parallel_regions(monkeypatch, tmp_path):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    env = launched_env(monkeypatch, tmp_path)
    assert env["GOMP_SPINCOUNT"] == str(CO_LOCATED_SPIN_COUNT) and "OMP_WAIT_POLICY" not in env


def test_an_operators_wait_policy_or_spin_count_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env = launched_env(monkeypatch, tmp_path)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env  # passive means what it says
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "500")
    assert launched_env(monkeypatch, tmp_path)["GOMP_SPINCOUNT"] == "500"


def test_every_worker_names_the_clusters_one_startup_lock(monkeypatch, tmp_path):
    local = recording_cluster(monkeypatch, tmp_path)
    for role in ("target", "draft", "target"):
        local._spawn_worker(role)
    locks = [cmd[cmd.index("--startup-lock") + 1] for cmd, _ in RecordingPopen.launched]
    assert len(locks) == 3 and set(locks) == {str(tmp_path / "startup.lock")}


def test_a_startup_lock_lets_one_worker_up_at_a_time(tmp_path):
    async def scenario() -> list[str]:
        first, second = StartupLock(tmp_path / "lock", "target"), StartupLock(tmp_path / "lock", "draft")
        await first.acquire()
        waiting = asyncio.create_task(second.acquire())
        await asyncio.sleep(0.3)
        states = [f"second waits: {not waiting.done()}"]
        first.release()
        await asyncio.wait_for(waiting, 5)
        states.append(f"second holds: {second.held}")
        second.release()
        second.release()  # a second release (warm-up done, then the worker's exit) does nothing
        await StartupLock(None, "pod").acquire()  # no file: nothing to wait for
        return states

    assert asyncio.run(scenario()) == ["second waits: True", "second holds: True"]


def test_a_service_that_exits_while_starting_is_a_tandem_error_with_its_logs_end(tmp_path):
    """`tandem up` prints it as ``tandem: error: ...`` (it was a RuntimeError: a traceback on the console)."""
    local = LocalCluster(ClusterSpec(target="tiny", log_dir=tmp_path))
    service = local._launch("target", "target-0", [sys.executable, "-c",
                                                    "import sys; sys.exit('tandem: error: no such device')"])
    with pytest.raises(TandemError, match=r"^target exited with code 1 while starting: no such device \(its log: "):
        local._wait([service], timeout_s=60)
    crashed = local._launch("target", "target-1", [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(TandemError, match=r"target exited with code 3 while starting; its log .* ends:\n"):
        local._wait([crashed], timeout_s=60)
