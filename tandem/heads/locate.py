"""Where ``--heads PATH|NAME`` points: a directory or file, or heads prepared under ``$TANDEM_HOME/heads``."""

from __future__ import annotations

from pathlib import Path

from tandem.heads.config import HeadsConfigError

HEADS_DIR = "heads"  # under the cache root, beside models/: one directory per prepared set (`tandem heads prepare`)


def heads_root(cache_root: Path) -> Path:
    return Path(cache_root) / HEADS_DIR


def resolve_heads(spec: str, cache_root: Path) -> Path:
    """``spec`` as a path when one exists there, else the prepared heads named ``spec``."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    named = heads_root(cache_root) / spec
    if named.exists():
        return named
    # Hidden directories are training work directories (.<name>.work), not heads.
    prepared = sorted(p.name for p in heads_root(cache_root).glob("*") if p.is_dir() and not p.name.startswith("."))
    known = f"prepared heads: {', '.join(prepared)}" if prepared else "none are prepared (`tandem heads prepare`)"
    raise HeadsConfigError(f"--heads {spec!r}: no such path, and no prepared heads of that name; {known}")
