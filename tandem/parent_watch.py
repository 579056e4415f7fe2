"""Processes that do not outlive the one that started them.

``LocalCluster`` (behind `tandem up`, the benchmarks and the tests) starts every service in a
session of its own, so a terminal's Ctrl-C reaches only the launcher, which then stops them in
order. A launcher that is killed outright (SIGKILL, SIGTERM without a handler, a crash) stops
nothing; without this, its workers would hold their memory and ports until someone finds them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

LAUNCHER_ENV = "TANDEM_LAUNCHER_PID"
POLL_S = 0.5


def watch_parent(parent_pid: int, on_gone: Callable[[], None]) -> threading.Thread:
    """Call ``on_gone`` (on a daemon thread) once this process's parent is no longer ``parent_pid``."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        on_gone()

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def stop_with_launcher(environ: dict[str, str] | os._Environ = os.environ) -> None:
    """In a service whose launcher named itself in ``TANDEM_LAUNCHER_PID``: when the launcher is gone,
    send ourselves SIGTERM, which drains as a `kill` would. Without the variable, nothing."""
    pid = environ.get(LAUNCHER_ENV, "")
    if pid.isdigit():
        watch_parent(int(pid), lambda: os.kill(os.getpid(), signal.SIGTERM))
