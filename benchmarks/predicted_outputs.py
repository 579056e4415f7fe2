"""Predicted outputs (OpenAI's ``prediction``): file edits with the original file as the request's prediction.

Six edit requests (benchmarks/data/code_edits): a file and one change; the model answers with the whole
updated file, so most of its answer copies the file, which the request sends as its prediction
(``SpeculationOptions.prediction``, ``tandem.spec.prediction``), as an editor plugin does. The file is in the
prompt too, so plain prompt lookup (``ngram``) can copy it as well; what the prediction adds is a source read
front to back from the answer's first token (rounds of every lookup source verify up to 15 tokens).

Methods, side by side on each request (greedy, batch 1): ``none`` (target-only: the reference), then in a
rotating order ``ngram`` and ``hybrid`` without and with the prediction (``+prediction``). Reported per
method: tokens/s and its ratio to target-only, tokens per round, acceptance, the prediction's tokens kept and
not kept, and how many answers were exactly target-only's (every one must be).

Writes predicted_outputs.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/predicted_outputs.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    grouped_bars,
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

NAME = "predicted_outputs"
TASKS = _REPO_ROOT / "benchmarks" / "data" / "code_edits" / "tasks.json"
PREDICTED = "+prediction"
METHODS = ("ngram", "ngram" + PREDICTED, "hybrid", "hybrid" + PREDICTED)
INSTRUCTION = ("Apply this change to the file below: {instruction}\n\nReply with the complete updated file in one "
               "fenced code block, and nothing else.\n\n```{language}\n{file}```")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_flags(parser, NAME, prompts=False, methods=METHODS)
    parser.set_defaults(max_new_tokens=512)
    parser.add_argument("--tasks", type=Path, default=TASKS, help="edit requests (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="the first N requests only")
    return parser


def load_tasks(path: Path, limit: int | None = None) -> list[dict[str, str]]:
    tasks = json.loads(path.read_text())
    return tasks[:limit] if limit is not None else tasks


def encode_tasks(tokenizer: Any, tasks: Sequence[dict[str, str]]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids through the chat template, prediction ids: the original file) per task."""
    from tandem.tokenizer import encode_messages

    return [(encode_messages(tokenizer, [{"role": "user", "content": INSTRUCTION.format(**task)}]),
             tokenizer.encode(task["file"], add_special_tokens=False)) for task in tasks]


def measure(target: Any, draft: Any, requests: Sequence[tuple[list[int], list[int]]], methods: Sequence[str],
            max_new_tokens: int, k: int, stop_ids: frozenset[int] = frozenset(),
            adaptive_k: bool = True) -> list[dict[str, Any]]:
    """One row per request and run: target-only first, then each method (rotating)."""
    from tandem.inprocess import GenerationRequest, SpeculativeGenerator
    from tandem.spec.options import SpecOptions

    generators = {"none": SpeculativeGenerator(target, None, SpecOptions("none", 0))}
    for method in methods:  # one generator per method, kept for the run: its cost model stays warm
        base = method.removesuffix(PREDICTED)
        generators[method] = SpeculativeGenerator(target, None if base == "ngram" else draft,
                                                  SpecOptions(base, k, adaptive_k))

    def one(i: int, method: str) -> dict[str, Any]:
        prompt, prediction = requests[i]
        request = GenerationRequest(list(prompt), max_new_tokens, stop_token_ids=stop_ids,
                                    prediction_ids=list(prediction) if method.endswith(PREDICTED) else [])
        (result,), seconds = timed(lambda: generators[method].generate([request]))
        s = result.stats
        return {"request": i, "method": method, "tokens": len(result.token_ids), "token_ids": result.token_ids,
                "seconds": seconds, "drafted": s.drafted, "accepted": s.accepted, "rounds": s.rounds,
                "prediction_accepted": s.prediction_accepted, "prediction_rejected": s.prediction_rejected}

    return rotating_runs(len(requests), methods, one, NAME)


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method, over every request: tokens/s, its ratio to target-only, tokens per round, acceptance, the
    prediction's tokens kept and not kept, and answers equal to target-only's."""
    return per_method(rows, "requests", lambda group: {
        "prediction_kept": sum(r["prediction_accepted"] for r in group),
        "prediction_not_kept": sum(r["prediction_rejected"] for r in group)})


def report(rows: list[dict[str, Any]], summary: list[dict[str, Any]], settings: dict[str, Any], out: Path,
           name: str) -> str:
    """Write JSON, markdown and the chart; the markdown table."""
    machine = machine_info()
    columns = ["method", "requests", "tokens", "tokens_per_s", "x_target_only", "tokens_per_round", "acceptance",
               "prediction_kept", "prediction_not_kept", "same_as_target_only"]
    table = markdown_table(summary, columns)
    write_json(out, name, {"machine": machine, "settings": settings, "summary": summary,
                           "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]})
    write_markdown(out, name, "Predicted outputs: file edits with the original file as the prediction",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{table}\n")
    fig, (ax,) = new_figure()
    grouped_bars(ax, [s["method"] for s in summary], {"tokens/s over target-only": [
        s["x_target_only"] for s in summary]}, "tokens/s over target-only")
    ax.set_title("file edits, greedy, batch 1")
    save_figure(fig, out, name)
    return table


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    methods = names_from(args.methods, METHODS)
    tasks = load_tasks(args.tasks, args.limit)
    _, tokenizer, target, draft, stop_ids = load_models(args, [m.removesuffix(PREDICTED) for m in methods])
    requests = encode_tasks(tokenizer, tasks)
    print(f"[{NAME}] {len(requests)} requests x (1 + {len(methods)}) runs", file=sys.stderr, flush=True)
    rows = measure(target, draft, requests, methods, args.max_new_tokens, args.k, stop_ids,
                   adaptive_k=not args.fixed_k)
    settings = {**run_settings(args, methods), "tasks": [t["id"] for t in tasks]}
    print(report(rows, summarize(rows), settings, args.out, args.name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
