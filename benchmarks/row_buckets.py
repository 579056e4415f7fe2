"""What bucketing a packed layer's row counts saves in memory and kernel builds, and what it costs a prefill.

oneDNN builds a kernel for every row count a packed weight is called with, and keeps it (its cache holds
1,024). A serving worker meets every count from one to its token budget: streams x tokens per round,
prompt chunks, whole prompts. ``tandem.models.row_padding`` now computes calls of more than 32 rows at
one of 16 sizes per octave (at most 1/16 more rows). Two rules, side by side in one run:

- ``exact``: the rule before the buckets (a call computes its own row count, small counts padded as
  measured at load);
- ``bucketed``: this checkout's rule.

Part 1, memory: for each rule, a fresh process loads ``--model`` and calls each distinct decoder-layer
weight shape with every row count from 2 to ``--max-rows`` (zeros), twice. It reports the kernels' count,
the process's resident memory before and after, and both passes' seconds: the first pass builds kernels,
the second shows whether they were kept. The head is left out: a worker calls it only on the rows that
need logits, and at 49,152 or more outputs a walk over 2,048 counts would take hours.

Part 2, compute: one whole prefill of each ``--lengths`` prompt through the engine under each rule in
turn (medians of ``--reps``), and whether both gave bitwise the same last-token logits (they must:
padded rows do not change a row).

Writes row_buckets.json / .md / .png into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/row_buckets.py` from anywhere
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
from tandem.models.row_padding import padded_rows  # noqa: E402

NAME = "row_buckets"
RULES = ("exact", "bucketed")


def exact_rows(padding: tuple[int, ...], rows: int) -> int:
    """The rule before the buckets: the measured padding of small counts, every other count as it is."""
    return padding[rows] if rows < len(padding) else rows


@contextmanager
def row_rule(rule: str) -> Iterator[Callable[[tuple[int, ...], int], int]]:
    """Packed layers compute rows by ``rule`` inside the block; yields the rule's function."""
    from tandem.models import packed

    chosen = {"exact": exact_rows, "bucketed": padded_rows}[rule]
    packed.padded_rows = chosen
    try:
        yield chosen
    finally:
        packed.padded_rows = padded_rows


def resident_mb() -> float:
    """This process's resident memory now, in MiB (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


def decoder_layer_shapes(model: Any) -> list[Any]:
    """One packed layer of each distinct (out, in, bias) shape outside the head."""
    from tandem.models.layers import RowStableLinear

    chosen: dict[tuple[int, int, bool], Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, RowStableLinear) and module.packed_weight is not None and "head" not in name:
            chosen.setdefault((module.out_features, module.in_features, module.bias is not None), module)
    return list(chosen.values())


def walk(layers: list[Any], max_rows: int, rule: str, dtype: Any) -> dict[str, Any]:
    """Each layer called with every row count 2..max_rows, twice, under ``rule``: kernels, memory and seconds."""
    import torch

    before = resident_mb()
    passes = []
    with row_rule(rule) as computed_rows, torch.inference_mode():
        kernels = {computed_rows(layers[0].padding, rows) for rows in range(2, max_rows + 1)}
        for _ in range(2):
            start = time.perf_counter()
            for rows in range(2, max_rows + 1):
                for layer in layers:
                    layer(torch.zeros(rows, layer.in_features, dtype=dtype))  # [rows, in]
            passes.append(time.perf_counter() - start)
    after = resident_mb()
    return {"rule": rule, "layer shapes": len(layers), "kernels per shape": len(kernels),
            "RSS before MB": before, "RSS after MB": after, "RSS growth MB": after - before,
            "first pass s": passes[0], "second pass s": passes[1]}


def load_engine(args: argparse.Namespace, prompt_tokens: int = 0) -> Any:
    from tandem.engine import ModelEngine

    cfg = engine_config(resolve_model_dir(args.model, args.cache_dir), args.dtype)
    return ModelEngine.load(dataclasses.replace(cfg, kv_cache_tokens=max(cfg.kv_cache_tokens, prompt_tokens + 64)))


def walk_in_this_process(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1 for ``args.walk``'s rule, in a process that has done nothing else."""
    engine = load_engine(args)
    layers = decoder_layer_shapes(engine.model)
    if not layers:
        raise SystemExit(f"{args.model}: no decoder layer is packed for oneDNN (a test-sized model, or packing "
                         "off on this CPU), so no row count builds a kernel: nothing to measure")
    return walk(layers, args.max_rows, args.walk, engine.backend.dtype)


def walk_in_fresh_process(args: argparse.Namespace, rule: str) -> dict[str, Any]:
    """Part 1 for ``rule`` in a child process: resident memory is a process's, and kernels are cached per process."""
    command = [sys.executable, str(Path(__file__).resolve()), "--walk", rule, "--model", args.model,
               "--dtype", args.dtype, "--max-rows", str(args.max_rows),
               *(("--cache-dir", args.cache_dir) if args.cache_dir else ())]
    print(f"[{NAME}] {rule}: counts 2..{args.max_rows} through each layer shape, twice, in a fresh process",
          file=sys.stderr, flush=True)
    done = subprocess.run(command, check=False, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {rule} walk failed (exit {done.returncode}); its error is above")
    return json.loads(done.stdout.strip().splitlines()[-1])


def prefill_costs(engine: Any, lengths: list[int], reps: int) -> list[dict[str, Any]]:
    """Part 2: median ms of a whole prefill of each length under each rule, and whether the logits agree."""
    import torch

    from tandem.engine import ForwardItem

    tokens = [t % engine.config.vocab_size for t in probe_tokens(max(lengths))]
    calls, keys, logits = [], [], {}
    for length in lengths:
        seq_id = (NAME, length)
        for rule in RULES:
            def run(seq_id=seq_id, length=length, rule=rule) -> torch.Tensor:
                with row_rule(rule):
                    return engine.forward([ForwardItem(seq_id, tokens[:length], num_logits=1, prompt=True)])[0]

            logits[(length, rule)] = run()
            engine.release(seq_id)
            calls.append((run, lambda seq_id=seq_id: engine.release(seq_id)))
            keys.append((length, rule))
    ms = {key: seconds * 1000 for key, seconds in zip(keys, interleaved_medians(calls, reps))}
    rows = []
    for length in lengths:
        exact, bucketed = ms[(length, "exact")], ms[(length, "bucketed")]
        rows.append({"prompt tokens": length, "rows computed": padded_rows((), length), "exact ms": exact,
                     "bucketed ms": bucketed,
                     "ratio": bucketed / exact,
                     "same logits": bool(torch.equal(logits[(length, "exact")], logits[(length, "bucketed")]))})
    return rows


def chart(walks: list[dict[str, Any]], prefills: list[dict[str, Any]], out: Path, name: str) -> Path:
    fig, (memory, cost) = new_figure(ncols=2, width=11.0)
    memory.bar([w["rule"] for w in walks], [w["RSS growth MB"] for w in walks])
    memory.set_ylabel("resident memory added by the walk, MiB")
    memory.set_title("every row count 2..max through each layer shape")
    cost.bar([str(r["prompt tokens"]) for r in prefills], [r["ratio"] for r in prefills])
    cost.axhline(1.0, color="grey", linewidth=0.8)
    cost.set_xlabel("prompt tokens")
    cost.set_ylabel("prefill ms, bucketed / exact")
    cost.set_title("what the padded rows cost a prefill")
    return save_figure(fig, out, name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a catalog name or a model directory (default: %(default)s)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="auto: bf16 where the CPU multiplies it natively, else fp32 (default: %(default)s)")
    parser.add_argument("--max-rows", type=int, default=2048,
                        help="the walk's largest row count: a worker's token budget (default: %(default)s)")
    parser.add_argument("--lengths", type=lambda text: sorted(set(positive_ints(text, "--lengths"))),
                        default=[300, 517, 1000, 1500, 2000],
                        help="comma-separated whole prompts' tokens for part 2 (default: 300,517,1000,1500,2000)")
    parser.add_argument("--reps", type=int, default=3, help="timed prefills per (length, rule) (default: %(default)s)")
    parser.add_argument("--walk", choices=RULES, help=argparse.SUPPRESS)  # the child process of part 1
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    parser.add_argument("--name", default=NAME)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_rows < 2 or args.reps < 1:
        raise SystemExit(f"--max-rows must be 2 or more and --reps 1 or more, got {args.max_rows} and {args.reps}")
    if args.walk:
        print(json.dumps(walk_in_this_process(args)))
        return 0
    walks = [walk_in_fresh_process(args, rule) for rule in RULES]
    engine = load_engine(args, max(args.lengths))
    print(f"[{NAME}] {len(args.lengths)} prefills x 2 rules x {args.reps} reps", file=sys.stderr, flush=True)
    prefills = prefill_costs(engine, args.lengths, args.reps)
    machine = machine_info()
    walk_table = markdown_table(walks, ["rule", "layer shapes", "kernels per shape", "RSS before MB", "RSS after MB",
                                       "RSS growth MB", "first pass s", "second pass s"])
    prefill_table = markdown_table(prefills, ["prompt tokens", "rows computed", "exact ms", "bucketed ms", "ratio",
                                              "same logits"])
    settings = {"model": args.model, "dtype": str(engine.backend.dtype).removeprefix("torch."),
                "max_rows": args.max_rows, "lengths": args.lengths, "reps": args.reps}
    write_json(args.out, args.name, {"machine": machine, "settings": settings, "walks": walks, "prefills": prefills})
    write_markdown(args.out, args.name, "Row buckets: kernels kept and memory, against a prefill's cost",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{walk_table}\n\n{prefill_table}\n")
    chart(walks, prefills, args.out, args.name)
    print(walk_table, prefill_table, sep="\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
