"""The cost of tensor parallelism per step on this machine: TP=1 against N ranks, with the collectives' share.

For each model and size, a fresh process loads the model as rank 0 of N (ranks 1..N-1
started as the worker starts them, each with cores/N threads), warms up, then times
forwards of 1 new token (a decode step) and 5 (verifying 4 drafts) over a cached
prefix, the KV rolled back between repetitions. Rank 0's clock also records the time
in its all-reduces and all-gathers (waiting for the slowest rank included) and in its
step broadcasts. Sizes a model's heads do not divide are recorded as refused
(SmolLM2's 9 heads split over 3 ranks, not 2).

On a CPU the ranks share one memory bus and the collectives go through TCP on
localhost, so this measures the protocol's overhead more than what TP buys on GPUs.

Writes tp_cost.json / .md into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/tp_cost.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import markdown_table, quick_default, write_json, write_markdown  # noqa: E402
from benchmarks.runners import engine_probe, resolve_model_dir  # noqa: E402
from benchmarks.tp_common import add_flags, in_fresh_process, parse_sizes, split_refusal  # noqa: E402
from tandem.config import EngineConfig  # noqa: E402
from tandem.parallel.engine import load_engine  # noqa: E402
from tandem.parallel.ranks import threads_per_rank  # noqa: E402

NAME = "tp_cost"
STEP_SIZES = (1, 5)
COLUMNS = ["model", "ranks", "threads_per_rank", "new_tokens", "ms_per_step", "vs_one_rank", "collective_ms",
           "collective_share", "broadcast_ms", "collectives_per_step"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tp_cost.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, models="smollm2,qwen-coder-0.5b", sizes="1,2,3")
    p.add_argument("--prefix-len", type=int, default=128, help="cached tokens before each timed step (default: 128)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed steps per size; medians kept (default: 20; --quick: 3)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 3 repetitions")
    return p


def measure_steps(model_dir: Path, ranks: int, dtype: str, prefix_len: int, reps: int) -> dict[str, Any]:
    """In a fresh process: median step seconds and collective seconds per step size, as rank 0 of ``ranks``."""
    cfg = EngineConfig(model_dir, dtype=dtype, kv_cache_tokens=4096, tensor_parallel_size=ranks)
    engine = load_engine(cfg)
    try:
        engine.warmup()
        clock = getattr(engine, "parallel", None)
        clock = clock.clock if clock else None
        if clock:
            clock.enabled = True
        out: dict[str, Any] = {"threads_per_rank": threads_per_rank(cfg) if ranks > 1 else None}
        for size in STEP_SIZES:
            probe = engine_probe(engine, prefix_len, size)
            step_s, collective_s, broadcast_s, calls = [], [], [], []
            for i in range(2 + reps):  # 2 untimed
                if clock:
                    clock.reset()
                started = time.perf_counter()
                probe.step()
                seconds = time.perf_counter() - started
                probe.undo()
                if i >= 2:
                    step_s.append(seconds)
                    if clock:
                        collective_s.append(clock.seconds)
                        broadcast_s.append(clock.broadcast_seconds)
                        calls.append(clock.calls)
            probe.close()
            out[size] = {"step_s": statistics.median(step_s),
                         "collective_s": statistics.median(collective_s) if clock else 0.0,
                         "broadcast_s": statistics.median(broadcast_s) if clock else 0.0,
                         "calls": calls[0] if calls else 0}
        return out
    finally:
        engine.close()


def rows_for(name: str, ranks: int, args: argparse.Namespace, one_rank: dict[int, float]) -> list[dict[str, Any]]:
    model_dir = resolve_model_dir(name, args.cache_dir)
    label = Path(name).name
    refused = split_refusal(model_dir, ranks)
    if refused:
        return [{"model": label, "ranks": ranks, "refused": refused}]
    measured = in_fresh_process(measure_steps, model_dir, ranks, args.dtype, args.prefix_len, args.reps)
    if "error" in measured:
        return [{"model": label, "ranks": ranks, "error": measured["error"]}]
    rows = []
    for size in STEP_SIZES:
        m = measured[size]
        if ranks == 1:
            one_rank[size] = m["step_s"]
        rows.append({
            "model": label, "ranks": ranks, "threads_per_rank": measured["threads_per_rank"] or os.cpu_count(),
            "new_tokens": size, "ms_per_step": m["step_s"] * 1000,
            "vs_one_rank": m["step_s"] / one_rank[size] if size in one_rank else None,
            "collective_ms": m["collective_s"] * 1000, "collective_share": m["collective_s"] / m["step_s"],
            "broadcast_ms": m["broadcast_s"] * 1000, "collectives_per_step": m["calls"],
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.reps = quick_default(args.reps, args.quick, 3, 20)
    if min(args.reps, args.prefix_len) <= 0:
        raise SystemExit("--reps and --prefix-len must be positive")
    rows: list[dict[str, Any]] = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        one_rank: dict[int, float] = {}
        for ranks in sorted(parse_sizes(args.tp)):  # 1 first: the baseline of the ratio
            rows.extend(rows_for(name, ranks, args, one_rank))
            print(rows[-1], file=sys.stderr)
    settings = {"models": args.models, "tp": args.tp, "dtype": args.dtype, "prefix_len": args.prefix_len,
                "reps": args.reps, "cpus": os.cpu_count(), "quick": args.quick}
    measured = [r for r in rows if "ms_per_step" in r]
    skipped = "\n".join(f"- {r['model']} x{r['ranks']}: {r.get('refused') or r.get('error')}"
                        for r in rows if "ms_per_step" not in r)
    table = markdown_table(measured, COLUMNS)
    write_json(args.out, NAME, {"settings": settings, "records": rows})
    write_markdown(args.out, NAME, "Tensor parallelism: cost per step on this machine",
                   f"Settings: `{settings}`\n\n{table}\n" + (f"\nNot measured:\n\n{skipped}\n" if skipped else ""))
    print(table)
    print(f"wrote {args.out / (NAME + '.json')}, {args.out / (NAME + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
