"""Lines a running process adds to its log file, read as it writes them (`tandem up` shows its coordinator's
stats lines on its own terminal, as `vllm serve` shows its engine's)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


class LogFollower:
    """New complete lines of the file ``path()`` names (read again each time: a restarted process may log to a
    new file, or start the old one afresh), from its end when first asked, each given to ``pick``: what it
    returns is kept, None drops the line."""

    def __init__(self, path: Callable[[], Path], pick: Callable[[str], str | None]) -> None:
        self._path = path
        self._pick = pick
        self._followed: Path | None = None
        self._offset = 0
        self._partial = ""  # a line not finished yet when last read

    def poll(self) -> list[str]:
        path = self._path()
        try:
            size = path.stat().st_size
        except OSError:
            return []
        if path != self._followed:  # (first asked, or another file): only what comes from now on
            self._followed, self._offset, self._partial = path, size, ""
            return []
        if size < self._offset:  # written afresh (truncated): from its start
            self._offset, self._partial = 0, ""
        if size == self._offset:
            return []
        with path.open("rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        self._offset += len(data)
        *lines, self._partial = (self._partial + data.decode("utf-8", errors="replace")).split("\n")
        return [kept for line in lines if (kept := self._pick(line)) is not None]


def coordinator_summary(line: str) -> str | None:
    """A coordinator log line's time and message when it is a stats line or a request's line, else None."""
    for logger, starts in ((" coordinator.stats_log: ", "stats: "), (" coordinator.service: ", "request ")):
        head, found, message = line.partition(logger)
        if found and message.startswith(starts):
            clock = head.split(" ")[1].split(",")[0] if " " in head else ""  # "2026-12-04 14:03:36,019 INFO"
            return f"{clock} {message}".strip()
    return None
