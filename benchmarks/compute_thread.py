"""What a second computing thread costs a CPU forward pass (tandem.compute_thread), side by side in one process.

The target's forward of 1, 4 and 9 new tokens (a decode step, a chain, an 8-node tree with its root)
over a 200-token context, timed in three states that alternate for --cycles cycles, so that machine
noise hits all alike:

  one thread      only the thread that loaded the model has computed (Tandem's rule)
  two threads     a second thread, still alive, has run one matmul (how workers ran before the rule:
                  the model loaded on the main thread, computing on the batcher's thread)
  after it exits  that thread has exited, and its OpenMP team with it

Writes compute_thread.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    grouped_bars,
    machine_info,
    machine_line,
    markdown_table,
    new_figure,
    save_figure,
    write_json,
    write_markdown,
)
from benchmarks.runners import engine_config, resolve_model_dir  # noqa: E402
from tandem.engine import ForwardItem, ModelEngine  # noqa: E402

CONTEXT = 200
SHAPES = {"decode (1 token)": None, "chain of 4": [-1, 0, 1, 2], "tree of 9": [-1, 0, 0, 0, 1, 1, 4, 5, 4]}
STATES = ("one thread", "two threads", "after it exits")


def forward_ms(engine: ModelEngine, parents: list[int] | None, reps: int) -> float:
    """Median ms of one forward of ``len(parents)`` new tokens (1 without) over the scratch sequence."""
    base = engine.seq_len("bench")
    rows = len(parents) if parents is not None else 1
    times = []
    for i in range(reps + 1):
        item = ForwardItem("bench", list(range(5, 5 + rows)), num_logits=rows, parents=parents)
        start = time.perf_counter()
        engine.forward([item])
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - start)
        engine.rollback("bench", base)
    return 1e3 * statistics.median(times)


def compute_once_then_wait(done: threading.Event) -> None:
    """One parallel op (this thread now has an OpenMP team), then idle until ``done``."""
    torch.randn(512, 512) @ torch.randn(512, 512)
    done.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen-coder-1.5b", help="catalog name or model directory")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--cycles", type=int, default=3, help="times the three states are visited in turn")
    parser.add_argument("--reps", type=int, default=7, help="forwards per shape per state visit (median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = ModelEngine.load(engine_config(resolve_model_dir(args.target, args.cache_dir), args.dtype, "auto"))
    engine.forward([ForwardItem("bench", list(range(100, 100 + CONTEXT)), prompt=True)])

    samples: dict[tuple[str, str], list[float]] = {(s, shape): [] for s in STATES for shape in SHAPES}
    for cycle in range(args.cycles):
        done = threading.Event()
        second = threading.Thread(target=compute_once_then_wait, args=(done,), name="second")
        for state in STATES:
            if state == "two threads":  # a live thread that has computed once, idle from then on
                second.start()
                time.sleep(0.2)
            elif state == "after it exits":
                done.set()
                second.join()
            for shape, parents in SHAPES.items():
                samples[(state, shape)].append(forward_ms(engine, parents, args.reps))
            print(f"cycle {cycle + 1}/{args.cycles} {state}: "
                  + ", ".join(f"{shape} {samples[(state, shape)][-1]:.1f} ms" for shape in SHAPES), flush=True)

    records = []
    for shape in SHAPES:
        one = statistics.median(samples[("one thread", shape)])
        record = {"forward": shape}
        for state in STATES:
            ms = statistics.median(samples[(state, shape)])
            record[f"{state} ms"] = round(ms, 1)
            record[f"{state} / one thread"] = round(ms / one, 2)
        records.append(record)
    info = machine_info()
    write_json(args.out, "compute_thread", {"machine": info, "args": vars(args), "records": records,
                                            "samples_ms": {f"{s} | {shape}": v for (s, shape), v in samples.items()}})
    columns = ["forward", *(f"{s} ms" for s in STATES), "two threads / one thread"]
    body = (f"{machine_line(info)}\n\n`{args.target}` {args.dtype}, {CONTEXT}-token context, median of "
            f"{args.cycles} visits x {args.reps} forwards per state.\n\n" + markdown_table(records, columns))
    write_markdown(args.out, "compute_thread", "A second computing thread and the forward pass", body)
    fig, (ax,) = new_figure()
    grouped_bars(ax, list(SHAPES), {s: [r[f"{s} ms"] for r in records] for s in STATES}, "forward ms")
    ax.set_title(f"{args.target} {args.dtype} forward, {info['cpu']}, {args.threads} threads", fontsize="small")
    save_figure(fig, args.out, "compute_thread")
    print(markdown_table(records, columns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
