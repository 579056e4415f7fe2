"""Many sequences in one forward: what attention costs per step as the batch grows, against another revision.

A serving target decodes many streams per forward. The SDPA backend computes every row in its attention
piece's call (tandem/attention/sdpa.py); this benchmark prices a decode step and a verify of a 5-token
chain per sequence at batch sizes 1..64, with this checkout's backend and the backend of another git
revision (``--baseline``: before short runs shared batched calls) loaded beside it, every (batch,
shape, backend) taking turns so that noise hits all of them. Two layouts of the sequences' cached
contexts:

- ``equal``: every sequence at ``--context`` tokens (streams started together from prompts of one
  length: the case where pieces line up best);
- ``spread``: sequence i of B at ``--context`` + i * ``--spread`` / B tokens, so no two share a piece
  until the batch outgrows the spread (the case where batching can gain least).

Each row: median ms per forward of both backends, their ratio and this checkout's tokens per second
(sequences x new tokens / forward). Writes batched_attention.json / .md / .png into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/batched_attention.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.attention_ab import baseline_backend  # noqa: E402
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

NAME = "batched_attention"
BASELINE = "ba2841d"  # every run's pieces in calls of their own, sequence by sequence
SHAPES = {"decode": 1, "chain 5": 5}  # new tokens per sequence
LAYOUTS = ("equal", "spread")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a catalog name or a model directory (default: %(default)s)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="auto: bf16 where the CPU multiplies it natively, else fp32 (default: %(default)s)")
    parser.add_argument("--batches", type=lambda text: sorted(set(positive_ints(text, "--batches"))),
                        default=[1, 4, 16, 64],
                        help="comma-separated sequences per forward (default: 1,4,16,64)")
    parser.add_argument("--context", type=int, default=128, help="cached tokens of the shortest sequence")
    parser.add_argument("--spread", type=int, default=256, help="the spread layout's range of context lengths")
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the other backend (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=7, help="timed forwards per (layout, batch, shape, backend)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    parser.add_argument("--name", default=NAME, help="file name of the results (without extension)")
    return parser


def contexts_of(layout: str, count: int, context: int, spread: int) -> list[int]:
    """Each sequence's cached length in ``layout``."""
    if layout == "equal":
        return [context] * count
    return [context + i * spread // count for i in range(count)]


def measure(engine: Any, backends: dict[str, Any], contexts: list[int], batches: list[int],
            reps: int) -> dict[tuple[int, str, str], float]:
    """Median ms of one forward per (batch, shape, backend) over sequences cached at ``contexts``; released after."""
    from tandem.engine import ForwardItem

    def tokens(count: int) -> list[int]:
        return [t % engine.config.vocab_size for t in probe_tokens(count)]

    seq_ids = [(NAME, i) for i in range(len(contexts))]
    for seq_id, context in zip(seq_ids, contexts):  # one prompt at a time: a 64-sequence prefill needs no big pool
        engine.forward([ForwardItem(seq_id, tokens(context), num_logits=1, prompt=True)])
    calls, keys = [], []
    for batch in batches:
        for shape, count in SHAPES.items():
            items = [ForwardItem(seq_id, tokens(count), num_logits=count) for seq_id in seq_ids[:batch]]
            for label, backend in backends.items():
                def run(items=items, backend=backend) -> None:
                    engine.backend = backend
                    engine.forward(items)

                def undo(batch=batch) -> None:
                    for seq_id, context in zip(seq_ids[:batch], contexts):
                        engine.rollback(seq_id, context)

                calls.append((run, undo))
                keys.append((batch, shape, label))
    try:
        medians = interleaved_medians(calls, reps)
    finally:
        for seq_id in seq_ids:
            engine.release(seq_id)
    return {key: seconds * 1000 for key, seconds in zip(keys, medians)}


def chart(rows: list[dict[str, Any]], out: Path, name: str) -> Path:
    fig, (ax,) = new_figure()
    for layout in LAYOUTS:
        for shape in SHAPES:
            picked = [r for r in rows if r["layout"] == layout and r["shape"] == shape]
            ax.plot([r["batch"] for r in picked], [r["ratio"] for r in picked], marker="o", label=f"{layout}, {shape}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences per forward")
    ax.set_ylabel("ms per forward, this checkout / baseline")
    ax.set_title("attention of many sequences: what one forward pays")
    ax.legend()
    return save_figure(fig, out, name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tandem.engine import ModelEngine

    largest = max(args.batches)
    tokens = largest * (args.context + args.spread + max(SHAPES.values())) + 1024
    cfg = engine_config(resolve_model_dir(args.model, args.cache_dir), args.dtype)
    engine = ModelEngine.load(dataclasses.replace(cfg, kv_cache_tokens=max(cfg.kv_cache_tokens, tokens)))
    backends = {"baseline": baseline_backend(args.baseline, engine.backend.dtype), "now": engine.backend}
    rows = []
    for layout in LAYOUTS:
        print(f"[{NAME}] {layout} contexts", file=sys.stderr, flush=True)
        contexts = contexts_of(layout, largest, args.context, args.spread)
        ms = measure(engine, backends, contexts, args.batches, args.reps)
        for batch in args.batches:
            for shape, count in SHAPES.items():
                base, now = ms[(batch, shape, "baseline")], ms[(batch, shape, "now")]
                rows.append({"layout": layout, "batch": batch, "shape": shape, "baseline ms": base, "now ms": now,
                             "ratio": now / base, "now tokens/s": batch * count / (now / 1000)})
    machine = machine_info()
    table = markdown_table(rows, ["layout", "batch", "shape", "baseline ms", "now ms", "ratio", "now tokens/s"])
    settings = {"model": args.model, "dtype": str(engine.backend.dtype).removeprefix("torch."), "context": args.context,
                "spread": args.spread, "batches": args.batches, "reps": args.reps, "baseline": args.baseline,
                "shapes": SHAPES}
    write_json(args.out, args.name, {"machine": machine, "settings": settings, "rows": rows})
    write_markdown(args.out, args.name, "Attention of many sequences per forward, against the baseline revision",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{table}\n")
    chart(rows, args.out, args.name)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
