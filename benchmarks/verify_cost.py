"""Verify cost over context length: one forward of a decode step, a chain and token trees, batch 1.

A round of speculation costs one forward of its proposal (a chain of k + 1 tokens, or a
tree of nodes) over the request's cached context. engine_speed measures chains over a
128-token prefix; this measures what grows with the context: each tree row attends over
the context on its own (tandem/attention/sdpa.py keeps every tree path bitwise a chain
forward of that path), so a 12-node tree pays twelve rows of attention over it. Prompts
of rag and summarization run at 800-2,000 tokens of context.

For each context and shape: the median milliseconds of one forward (the shapes take
turns, so noise hits all), and its ratio to the decode step at that context.

Writes verify_cost.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/verify_cost.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    DEFAULT_RESULTS_DIR,
    interleaved_medians,
    machine_info,
    machine_line,
    markdown_table,
    new_figure,
    positive_ints,
    save_figure,
    write_json,
    write_markdown,
)
from benchmarks.runners import engine_config, probe_tokens, resolve_model_dir  # noqa: E402

NAME = "verify_cost"
# name -> parents of the new tokens (None: a chain). The trees are of the shapes EAGLE-2's
# expansion gives: wide near the root, one or two deep branches.
SHAPES: dict[str, tuple[int, list[int] | None]] = {
    "decode": (1, None),
    "chain 5": (5, None),
    "tree 6": (6, [-1, -1, 0, 0, 2, 4]),
    "tree 12": (12, [-1, -1, -1, 0, 0, 1, 3, 3, 4, 6, 6, 9]),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen-coder-1.5b", help="a catalog name or a model directory")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--contexts", default="300,1000,2000", help="comma-separated cached context lengths")
    parser.add_argument("--reps", type=int, default=7, help="timed forwards per shape and context (median kept)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    parser.add_argument("--name", default=NAME, help="file name of the results (without extension)")
    return parser


def contexts_from(text: str) -> list[int]:
    return positive_ints(text, "--contexts")


def measure(engine: Any, context: int, reps: int) -> dict[str, float]:
    """Median ms of one forward of each shape over ``context`` cached tokens; the sequences are released."""
    from tandem.engine import ForwardItem

    calls = []
    for name, (count, parents) in SHAPES.items():
        seq_id = (NAME, name, context)
        tokens = [t % engine.config.vocab_size for t in probe_tokens(context + count)]  # tiny vocabularies too
        engine.forward([ForwardItem(seq_id, tokens[:context], num_logits=1, prompt=True)])
        item = ForwardItem(seq_id, tokens[context:], num_logits=count, parents=parents)
        calls.append((lambda item=item: engine.forward([item]),
                      lambda seq_id=seq_id: engine.rollback(seq_id, context)))
    try:
        medians = interleaved_medians(calls, reps)
    finally:
        for name in SHAPES:
            engine.release((NAME, name, context))
    return {name: seconds * 1000 for name, seconds in zip(SHAPES, medians)}


def chart(rows: list[dict[str, Any]], out: Path, name: str, column: str = "{shape} ms",
          ylabel: str = "ms per forward (median)", title: str = "one verify forward, batch 1") -> Path:
    """One line per shape over the contexts: each row's ``column`` (with the shape's name filled in)."""
    fig, (ax,) = new_figure()
    for shape in SHAPES:
        ax.plot([r["context"] for r in rows], [r[column.format(shape=shape)] for r in rows], marker="o", label=shape)
    ax.set_xlabel("cached context (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return save_figure(fig, out, name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    contexts = contexts_from(args.contexts)
    import torch

    from tandem.engine import ModelEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model, args.cache_dir)
    engine = ModelEngine.load(engine_config(model_dir, args.dtype))
    rows = []
    for context in contexts:
        print(f"[{NAME}] context {context}", file=sys.stderr, flush=True)
        ms = measure(engine, context, args.reps)
        row: dict[str, Any] = {"context": context}
        for name, value in ms.items():
            row[f"{name} ms"] = value
            row[f"{name} / decode"] = value / ms["decode"]
        rows.append(row)
    machine = machine_info()
    columns = ["context", *(f"{n} ms" for n in SHAPES), *(f"{n} / decode" for n in SHAPES if n != "decode")]
    table = markdown_table(rows, columns)
    settings = {"model": args.model, "dtype": args.dtype, "contexts": contexts, "reps": args.reps, "shapes": SHAPES}
    write_json(args.out, args.name, {"machine": machine, "settings": settings, "rows": rows})
    write_markdown(args.out, args.name, "Verify cost over context length",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{table}\n")
    chart(rows, args.out, args.name)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
