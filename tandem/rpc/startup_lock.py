"""Co-located workers take turns to come up: each holds a file lock while it loads, packs and warms up.

A worker calibrates itself as it starts: it times each packed weight's row counts
(``tandem.models.row_padding``) and fits its forward cost over the warm-up's passes
(``tandem.cost_fit``), and adaptive k and the heads' node budget plan with that fit. Timed while
another worker on the same cores computes, it is several times too dear: measured with `tandem up`
on 2 cores, a draft worker warming up beside its target fitted a 102 ms step (23 ms alone), so
adaptive k never drafted, and a draft that never drafts never measures itself again. Workers on
machines of their own (pods) have nothing to wait for and take no lock.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)


class StartupLock:
    """An exclusive ``flock`` on ``path`` (None: no lock), held from ``acquire`` until ``release``."""

    def __init__(self, path: Path | None, role: str) -> None:
        self.path = path
        self.role = role
        self._fd: int | None = None

    async def acquire(self) -> None:
        if self.path is None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        start = time.monotonic()
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("%s: waiting for the workers beside it to warm up (%s)", self.role, self.path)
                # A blocking flock, off the event loop (not on the model thread: it computes nothing).
                await asyncio.get_running_loop().run_in_executor(None, fcntl.flock, fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        waited = time.monotonic() - start
        if waited >= 0.5:
            log.info("%s: waited %.1fs for the workers beside it to warm up (%s)", self.role, waited, self.path)

    def release(self) -> None:
        """Let the next worker come up (again: nothing). Closing the file drops the lock, and so does exiting."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None
