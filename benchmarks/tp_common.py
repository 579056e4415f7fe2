"""What the tensor-parallel benchmarks share: a fresh process per measurement, and which sizes a model splits into.

Each (model, tensor-parallel size) is measured in a process of its own, spawned, acting
as rank 0 exactly as a target worker does (it starts ranks 1..N-1 itself), so that no
measurement inherits another's memory or warm caches.
"""

from __future__ import annotations

import argparse
import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import DEFAULT_RESULTS_DIR
from tandem.config import ModelConfig
from tandem.errors import InvalidRequestError
from tandem.models.tensor_parallel import check_splittable


def in_fresh_process(target: Callable[..., dict[str, Any]], *args: Any, timeout_s: float = 3600) -> dict[str, Any]:
    """``target(*args)`` in a spawned process; its dict result (or the error it raised, as ``{"error": ...}``)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    process = ctx.Process(target=_run_and_report, args=(results, target, args))
    process.start()
    try:
        return results.get(timeout=timeout_s)
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()


def _run_and_report(results: Any, target: Callable[..., dict[str, Any]], args: tuple) -> None:
    try:
        results.put(target(*args))
    except Exception as exc:  # noqa: BLE001 - reported as a row, so one failure does not lose the others
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def split_refusal(model_dir: Path, ranks: int) -> str | None:
    """Why ``ranks`` cannot split this model (None: they can)."""
    try:
        check_splittable(ModelConfig.from_dir(model_dir), ranks)
    except InvalidRequestError as exc:
        return str(exc)
    return None


def parse_sizes(text: str) -> list[int]:
    sizes = [int(s) for s in text.split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--tp needs positive tensor-parallel sizes, got {text!r}")
    return sizes


def add_flags(p: argparse.ArgumentParser, models: str, sizes: str) -> None:
    """The flags both tensor-parallel benchmarks take."""
    p.add_argument("--models", default=models,
                   help="comma-separated catalog names or model directories (default: %(default)s)")
    p.add_argument("--tp", default=sizes, help="tensor-parallel sizes; a size a model cannot split into is "
                                               "recorded as refused, with the reason (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="runtime dtype (default: %(default)s)")
    p.add_argument("--cache-dir", default=None,
                   help="Tandem model cache root (default: $TANDEM_HOME or ~/.cache/tandem)")
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR, help="results directory (default: %(default)s)")
