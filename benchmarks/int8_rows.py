"""Where a lean draft's int8 kernel stops paying: one prompt pass, int8 against a dequantized weight, by rows.

A lean draft (int8 weights, ``tandem/models/quantize.py``) multiplies through
``aten._weight_int8pack_mm``, which works row by row: fast for decode steps, slower than
a dense matmul for long inputs. ``Int8Linear`` sends inputs past a crossover through a
weight dequantized for the call, which itself costs a pass over every weight. This times
one prompt pass of N tokens through the whole draft (int8, its head cut to the first ``--vocab`` ids
as a lean draft's is) both ways (the two take turns, medians
kept) and marks the way the engine's rule (``_dense_beats_int8``) takes at each N.

Writes int8_rows.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/int8_rows.py` from anywhere
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
from benchmarks.runners import probe_tokens, resolve_model_dir  # noqa: E402

NAME = "int8_rows"
WAYS = ("int8", "dense")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen-coder-0.5b", help="the draft: a catalog name or a model directory")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--vocab", type=int, default=None, metavar="N",
                        help="score only the first N ids, as a lean draft does (default: the draft default, "
                             "tandem.config.DEFAULT_DRAFT_VOCAB_LIMIT; 0: the whole vocabulary)")
    parser.add_argument("--rows", default="8,16,32,48,56,64,72,80,96,128", help="comma-separated prompt lengths")
    parser.add_argument("--reps", type=int, default=7, help="timed passes per way and length (median kept)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    parser.add_argument("--name", default=NAME, help="file name of the results (without extension)")
    return parser


def rows_from(text: str) -> list[int]:
    return positive_ints(text, "--rows")


@contextmanager
def forced(way: str):
    """Every ``Int8Linear`` call takes ``way`` while inside."""
    from tandem.models import quantize

    rule = quantize._dense_beats_int8
    quantize._dense_beats_int8 = lambda dtype, rows: way == "dense"
    try:
        yield
    finally:
        quantize._dense_beats_int8 = rule


def measure(engine: Any, rows: int, reps: int) -> dict[str, float]:
    """Median ms of one ``rows``-token prompt pass each way; the sequence is released after each."""
    from tandem.engine import ForwardItem

    tokens = [t % engine.config.vocab_size for t in probe_tokens(rows)]  # tiny vocabularies too
    seq_id = (NAME, rows)

    def pass_through(way: str) -> None:
        with forced(way):
            engine.forward([ForwardItem(seq_id, tokens, num_logits=1, prompt=True)])

    calls = [(lambda way=way: pass_through(way), lambda: engine.release(seq_id)) for way in WAYS]
    return {way: seconds * 1000 for way, seconds in zip(WAYS, interleaved_medians(calls, reps))}


def chart(table: list[dict[str, Any]], out: Path, name: str) -> Path:
    fig, (ax,) = new_figure()
    for way in WAYS:
        ax.plot([r["rows"] for r in table], [r[f"{way} ms"] for r in table], marker="o", label=way)
    ax.set_xlabel("prompt tokens in the pass (rows)")
    ax.set_ylabel("ms per pass (median)")
    ax.set_title("lean draft: int8 kernel against a dequantized weight")
    ax.legend()
    return save_figure(fig, out, name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lengths = rows_from(args.rows)
    import torch

    from tandem.config import DEFAULT_DRAFT_VOCAB_LIMIT, EngineConfig
    from tandem.engine import ModelEngine
    from tandem.models import quantize

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model, args.cache_dir)
    vocab = DEFAULT_DRAFT_VOCAB_LIMIT if args.vocab is None else args.vocab
    config = EngineConfig(model_dir, dtype=args.dtype, quantization="int8", vocab_limit=vocab or None,
                          prefix_caching=False)
    engine = ModelEngine.load(config)
    dtype = getattr(torch, args.dtype)
    table = []
    for rows in lengths:
        print(f"[{NAME}] {rows} rows", file=sys.stderr, flush=True)
        ms = measure(engine, rows, args.reps)
        faster = min(WAYS, key=lambda way: ms[way])
        chosen = "dense" if quantize._dense_beats_int8(dtype, rows) else "int8"
        table.append({"rows": rows, "int8 ms": ms["int8"], "dense ms": ms["dense"], "faster": faster,
                      "rule takes": chosen, "rule's loss ms": ms[chosen] - ms[faster]})
    machine = machine_info()
    columns = ["rows", "int8 ms", "dense ms", "faster", "rule takes", "rule's loss ms"]
    md = markdown_table(table, columns)
    settings = {"model": args.model, "dtype": args.dtype, "vocab_limit": vocab or None, "rows": lengths,
                "reps": args.reps, "native_bf16": quantize._NATIVE_BF16}
    write_json(args.out, args.name, {"machine": machine, "settings": settings, "rows": table})
    write_markdown(args.out, args.name, "Lean draft: int8 kernel against a dequantized weight, by rows",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{md}\n")
    chart(table, args.out, args.name)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
