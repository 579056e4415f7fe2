"""The workers file: which worker replicas a coordinator should use, by role.

``tandem up`` writes it and the coordinator (``--discovery file``) re-reads it
when it changes, so a local fleet grows and shrinks without a restart::

    {"target": ["127.0.0.1:50052", "127.0.0.1:50062"], "draft": ["127.0.0.1:50053"]}

Writes are atomic (a temporary file renamed over the old one), so a reader
never sees half a file. Torch-free: the coordinator reads it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from tandem.errors import InvalidRequestError

ROLES = ("target", "draft")


def check_address(addr: str) -> str:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6), or a clear error naming the address."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise InvalidRequestError(f"worker address {addr!r} is not HOST:PORT")
    return addr


def parse_workers(text: str, source: str) -> dict[str, list[str]]:
    """The addresses per role in a workers file's text; ``source`` names the file in errors."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{source}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"{source}: expected an object like {{\"target\": [...], \"draft\": [...]}}")
    unknown = set(data) - set(ROLES)
    if unknown:
        raise InvalidRequestError(f"{source}: unknown keys {sorted(unknown)}; expected {', '.join(ROLES)}")
    workers: dict[str, list[str]] = {}
    for role in ROLES:
        addrs = data.get(role, [])
        if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
            raise InvalidRequestError(f"{source}: {role!r} must be a list of \"HOST:PORT\" strings")
        workers[role] = [check_address(a) for a in addrs]
    return workers


def read_workers(path: Path) -> dict[str, list[str]]:
    return parse_workers(Path(path).read_text(), str(path))


def write_workers(path: Path, workers: dict[str, list[str]]) -> None:
    """Replace the file atomically with these addresses."""
    path = Path(path)
    body = json.dumps({role: list(workers.get(role, [])) for role in ROLES}, indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
