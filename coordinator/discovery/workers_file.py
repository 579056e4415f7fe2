"""File discovery: a JSON workers file (``tandem.workers_file``), re-read when it changes.

The file is checked every ``interval_s`` (its size and modification time,
then its text); writers replace it atomically. A file that is missing or
malformed is reported once and leaves the current replicas as they are:
an operator's typo must not drain the fleet.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from tandem.errors import InvalidRequestError
from tandem.workers_file import parse_workers

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5


class WorkersFileSource:
    def __init__(self, role: str, path: Path, interval_s: float = POLL_INTERVAL_S) -> None:
        self.role = role
        self.path = Path(path)
        self.interval_s = interval_s

    async def watch(self) -> AsyncIterator[frozenset[str]]:
        last_stamp: tuple[int, int] | None = None
        last_text: str | None = None
        last_problem = ""
        while True:
            try:
                stat = self.path.stat()
                stamp = (stat.st_mtime_ns, stat.st_size)
                if stamp != last_stamp:
                    last_stamp = stamp
                    text = self.path.read_text()
                    if text != last_text:
                        last_text = text
                        yield frozenset(parse_workers(text, str(self.path))[self.role])
                last_problem = ""
            except (OSError, InvalidRequestError) as exc:
                if str(exc) != last_problem:  # say it once, not every half second
                    log.error("workers file: %s; keeping the current %s replicas", exc, self.role)
                    last_problem = str(exc)
                last_stamp = None
            await asyncio.sleep(self.interval_s)
