"""A service whose launcher is killed outright stops itself (tandem/parent_watch.py), through real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

# The service: watches its launcher, turns SIGTERM into a clean exit that leaves a mark.
SERVICE = """
import pathlib, signal, sys, time
from tandem.parent_watch import stop_with_launcher
def stopped(*_):
    pathlib.Path(sys.argv[1]).write_text("drained")
    sys.exit(0)
signal.signal(signal.SIGTERM, stopped)
stop_with_launcher()
print("ready", flush=True)
time.sleep(60)
"""

# The launcher: starts the service in a session of its own, naming itself, as LocalCluster does.
LAUNCHER = """
import os, subprocess, sys
from tandem.parent_watch import LAUNCHER_ENV
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True,
                         env={**os.environ, LAUNCHER_ENV: str(os.getpid())}, stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
import time; time.sleep(60)
"""


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie that its new parent (init here) has not reaped yet."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return False


def test_a_service_stops_when_its_launcher_is_killed(tmp_path):
    mark = tmp_path / "mark"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, SERVICE, str(mark)], stdout=subprocess.PIPE,
                                text=True)
    try:
        service_pid = int(launcher.stdout.readline())
        assert not mark.exists()
        launcher.send_signal(signal.SIGKILL)  # no handler, no cleanup: only the service's own watch can act
        launcher.wait(timeout=10)
        assert _wait_gone(service_pid, timeout_s=15), "the service outlived its launcher"
        assert mark.read_text() == "drained"  # it went through its SIGTERM path, not a kill
    finally:
        launcher.kill()


def test_without_a_launcher_nothing_is_watched():
    from tandem.parent_watch import stop_with_launcher

    before = {t.name for t in threading.enumerate()}
    stop_with_launcher({})
    stop_with_launcher({"TANDEM_LAUNCHER_PID": "not-a-pid"})
    after = {t.name for t in threading.enumerate()}
    assert "parent-watch" not in after - before
